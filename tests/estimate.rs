//! Integration tests of token estimation: the request model (built in code and read from
//! OpenAI / Anthropic JSON bodies), UTF-16 character counting, the naive, model-aware and
//! adaptive estimators, and how the bulkhead sizes, previews and learns from admissions.
//!
//! Figures come from the upstream behaviour reference (`upstream-behavior.md` §1.3, §3.1, §3.7,
//! §13) and RUST-DESIGN §4 Q17 (override ratios must be finite and > 0, checked when built).

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, AdaptiveEstimator, AdaptiveEstimatorBuilder, Content,
    ContentBlock, Correction, DEFAULT_OUTPUT_CAP, Estimator, EstimatorError, LlmBulkhead,
    LlmRequest, Memo, ModelAwareEstimator, NaiveEstimator, OpaqueBlockTokens, RequestError,
    Reservation, RunError, TokenBudget, TokenEstimate, TokenUsage, Verdict,
};
use proptest::prelude::*;
use serde_json::{Value, json};

// ===== helpers =====

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

fn xs(n: usize) -> String {
    "x".repeat(n)
}

/// A request for `model` with one user message of `chars` ASCII characters.
fn request(model: &str, chars: usize) -> LlmRequest {
    LlmRequest::new().model(model).user(xs(chars))
}

/// UTF-16 code units of `text`, the reference count.
fn utf16(text: &str) -> u64 {
    text.encode_utf16().count() as u64
}

/// The model-aware estimator with no options.
fn plain() -> ModelAwareEstimator {
    ModelAwareEstimator::builder()
        .build()
        .expect("no overrides to refuse")
}

/// An adaptive estimator over [`plain`] with the given options.
fn adaptive(
    smoothing: f64,
    min_samples: u64,
    clamp: (f64, f64),
    max_models: usize,
) -> AdaptiveEstimator {
    AdaptiveEstimator::builder(plain())
        .smoothing(smoothing)
        .min_samples(min_samples)
        .min_correction(clamp.0)
        .max_correction(clamp.1)
        .max_models(max_models)
        .build()
        .expect("valid adaptive options")
}

fn input_of(estimator: &impl Estimator, request: &LlmRequest) -> u64 {
    estimator.estimate(request).expect("estimate fits").input
}

/// The kinds of the request's opaque blocks, in visiting order.
fn kinds(request: &LlmRequest) -> Vec<String> {
    let mut kinds = Vec::new();
    request.for_each_opaque_block(|kind| kinds.push(kind.to_owned()));
    kinds
}

/// Observed models of an adaptive estimator, oldest first.
fn models(adaptive: &AdaptiveEstimator) -> Vec<String> {
    adaptive
        .corrections()
        .into_iter()
        .map(|c| c.model)
        .collect()
}

fn parse(body: &Value) -> LlmRequest {
    serde_json::from_value(body.clone()).expect("a valid request body")
}

fn parse_err(body: Value) -> String {
    serde_json::from_value::<LlmRequest>(body)
        .expect_err("the body must be refused")
        .to_string()
}

/// A hook recording every model it is told about, and the record.
fn recording_hook() -> (
    Arc<Mutex<Vec<String>>>,
    impl Fn(&str) + Send + Sync + 'static,
) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    (seen, move |model: &str| {
        log.lock().unwrap().push(model.to_owned())
    })
}

fn seen(log: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    log.lock().unwrap().clone()
}

/// A bulkhead for `model` with a 100,000-token budget and the default estimator.
fn budgeted(model: &str) -> LlmBulkhead {
    LlmBulkhead::builder(model, 8)
        .token_budget(TokenBudget::new(100_000))
        .build()
        .expect("valid configuration")
}

/// A bulkhead with a 100,000-token budget sized by `estimator`.
fn budgeted_with(estimator: impl Estimator + 'static) -> LlmBulkhead {
    LlmBulkhead::builder("gpt-4o", 8)
        .token_budget(TokenBudget::new(100_000))
        .estimator(estimator)
        .build()
        .expect("valid configuration")
}

/// A removed `"content"` of message `index`, so the rest of a body can be compared.
fn without_content(mut body: Value, index: usize) -> Value {
    body["messages"][index]
        .as_object_mut()
        .expect("a message object")
        .remove("content");
    body
}

/// A realistic OpenAI chat-completions body. Its text is 49 + 25 + 27 + 19 = 120 UTF-16 units
/// (119 chars, 126 bytes): the image caption ends with U+1F5BC U+FE0F (3 units).
fn openai_body() -> Value {
    json!({
        "model": "gpt-4o-2024-08-06",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant. Réponds en français."},
            {"role": "user", "name": "alice", "content": [
                {"type": "text", "text": "What's in this image? \u{1F5BC}\u{FE0F}"},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "high"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [{
                "id": "call_abc123",
                "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}
            }]},
            {"role": "tool", "tool_call_id": "call_abc123", "content": "{\"temp_c\":18,\"sky\":\"clear\"}"},
            {"role": "user", "content": "Merci ! Et demain ?"}
        ],
        "max_completion_tokens": 512,
        "temperature": 0.7,
        "top_p": 1,
        "stream": true,
        "stream_options": {"include_usage": true},
        "tools": [{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"]
                }
            }
        }],
        "tool_choice": "auto",
        "user": "user-1234"
    })
}

/// A realistic Anthropic messages body with a block system prompt. Its text is
/// 29 + 12 (system) + 35 + 27 (messages) = 103 UTF-16 units; the tool result's nested text is
/// inside an opaque block and does not count.
fn anthropic_body() -> Value {
    json!({
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 1024,
        "system": [
            {"type": "text", "text": "You are a meticulous analyst.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "日本語で答えてください。"}
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                {"type": "document", "source": {"type": "url", "url": "https://example.com/q3.pdf"},
                 "title": "Q3 report", "citations": {"enabled": true}},
                {"type": "text", "text": "Summarise the chart and the report.",
                 "cache_control": {"type": "ephemeral", "ttl": "1h"}}
            ]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look up the figures."},
                {"type": "tool_use", "id": "toolu_01", "name": "lookup", "input": {"quarter": "Q3"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "is_error": false,
                 "content": [{"type": "text", "text": "revenue: 12.4M"}]}
            ]}
        ],
        "metadata": {"user_id": "u-42"},
        "temperature": 0.2,
        "stop_sequences": ["\n\nHuman:"],
        "tools": [{
            "name": "lookup",
            "description": "Look up quarterly figures",
            "input_schema": {"type": "object", "properties": {"quarter": {"type": "string"}}}
        }],
        "stream": false
    })
}

// ===== request model (serde) =====

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

// ===== character counting =====

#[test]
fn text_is_counted_in_utf16_code_units() {
    let family = "\u{1F468}\u{200D}\u{1F469}\u{200D}\u{1F467}";
    let straddling = format!("{}\u{1F600}é", "a".repeat(65_535));
    let long_mixed = "aé日\u{1F600}".repeat(20_000);
    let cases: [(&str, u64); 15] = [
        ("", 0),
        ("hello, world", 12),
        ("héllo wörld ñ", 13),           // Latin-1: 2 bytes, 1 unit each
        ("\u{00FF}\u{00E9}\u{00C0}", 3), // more Latin-1
        ("€ → ∑", 5),                    // 3-byte BMP characters
        ("日本語のテキスト", 8),         // CJK
        ("\u{1F600}", 2),                // one astral emoji: a surrogate pair
        ("\u{1F44D}\u{1F3FD}", 4),       // emoji + skin tone modifier
        (family, 8),                     // 3 emoji joined by 2 ZWJ
        ("\u{1D11E}", 2),                // musical symbol G clef
        ("\u{10FFFF}", 2),               // the last code point
        ("a\u{1F600}b\u{20AC}c", 6),     // mixed widths
        (&straddling, 65_535 + 2 + 1),   // a 4-byte char across a 64 KiB chunk border
        (&long_mixed, 20_000 * 5),
        ("x", 1),
    ];
    for (text, units) in cases {
        assert_eq!(utf16(text), units, "reference count of {text:.20?}");
        assert_eq!(
            LlmRequest::new().user(text).text_len(),
            units,
            "{text:.20?}"
        );
        assert_eq!(Content::from(text).text_len(), units);
        assert_eq!(
            Content::Blocks(vec![
                ContentBlock::text(text),
                ContentBlock::opaque("image")
            ])
            .text_len(),
            units
        );
        assert_eq!(LlmRequest::new().system(text).text_len(), units);
    }
    let ascii = xs(2_000);
    assert_eq!(LlmRequest::new().user(ascii.as_str()).text_len(), 2_000);

    // Multi-byte characters cut at every offset of the first few hundred bytes, so any
    // chunked counting sees them straddle its chunk borders.
    for prefix in 0..600 {
        let text = format!(
            "{}\u{1F600}é日{}",
            "a".repeat(prefix),
            "\u{10FFFF}".repeat(300)
        );
        assert_eq!(
            LlmRequest::new().user(text.as_str()).text_len(),
            prefix as u64 + 2 + 1 + 1 + 600,
            "prefix {prefix}"
        );
    }
    let astral_only = "\u{1F600}".repeat(1_000);
    assert_eq!(
        LlmRequest::new().user(astral_only.as_str()).text_len(),
        2_000
    );
}

#[test]
fn text_len_sums_messages_system_and_text_blocks_only() {
    let request = LlmRequest::new()
        .system(vec![
            ContentBlock::text("12345678"),
            ContentBlock::opaque("image"),
        ])
        .user("abcd")
        .message("assistant", vec![ContentBlock::text("\u{1F600}")])
        .user(vec![
            ContentBlock::opaque("document"),
            ContentBlock::text(""),
            ContentBlock::text("日本"),
        ]);
    assert_eq!(request.text_len(), 8 + 4 + 2 + 2);
    assert_eq!(
        kinds(&request),
        ["document", "image"],
        "messages first, then system"
    );
}

/// Generated message content, and the texts it holds.
#[derive(Clone, Debug)]
enum RawContent {
    Text(String),
    Blocks(Vec<Option<String>>),
}

impl RawContent {
    fn content(&self) -> Content {
        match self {
            RawContent::Text(text) => Content::from(text.as_str()),
            RawContent::Blocks(blocks) => Content::Blocks(
                blocks
                    .iter()
                    .map(|b| match b {
                        Some(text) => ContentBlock::text(text.as_str()),
                        None => ContentBlock::opaque("image"),
                    })
                    .collect(),
            ),
        }
    }

    fn units(&self) -> u64 {
        match self {
            RawContent::Text(text) => utf16(text),
            RawContent::Blocks(blocks) => blocks.iter().flatten().map(|t| utf16(t)).sum(),
        }
    }
}

fn text_strategy() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        prop::collection::vec(any::<char>(), 0..64).prop_map(String::from_iter),
        "[ -~]{0,80}",
        "[a-zé日\u{1F600}]{0,40}",
    ]
}

fn content_strategy() -> impl Strategy<Value = RawContent> {
    prop_oneof![
        text_strategy().prop_map(RawContent::Text),
        prop::collection::vec(prop::option::of(text_strategy()), 0..5).prop_map(RawContent::Blocks),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn text_len_matches_encode_utf16(
        messages in prop::collection::vec(content_strategy(), 0..6),
        system in prop::option::of(content_strategy()),
    ) {
        let mut request = LlmRequest::new();
        for message in &messages {
            request = request.user(message.content());
        }
        if let Some(system) = &system {
            request = request.system(system.content());
        }
        let expected: u64 = messages.iter().map(RawContent::units).sum::<u64>()
            + system.as_ref().map_or(0, RawContent::units);
        prop_assert_eq!(request.text_len(), expected);
    }

    #[test]
    fn code_built_requests_round_trip_through_json(
        model in prop::option::of("[a-zA-Z0-9.-]{0,20}"),
        messages in prop::collection::vec(("[a-z]{1,10}", content_strategy()), 0..4),
        system in prop::option::of(content_strategy()),
        max_tokens in prop::option::of(any::<u64>()),
        extra in prop::option::of(any::<u64>()),
    ) {
        let mut request = LlmRequest::new();
        if let Some(model) = &model {
            request = request.model(model.as_str());
        }
        for (role, content) in &messages {
            request = request.message(role.as_str(), content.content());
        }
        if let Some(system) = &system {
            request = request.system(system.content());
        }
        if let Some(n) = max_tokens {
            request = request.max_tokens(n);
        }
        if let Some(n) = extra {
            request = request.extra_input_tokens(n);
        }
        let text = serde_json::to_string(&request).unwrap();
        let back: LlmRequest = serde_json::from_str(&text).unwrap();
        prop_assert_eq!(back.text_len(), request.text_len());
        prop_assert_eq!(kinds(&back), kinds(&request));
        prop_assert_eq!(back, request);
    }

    #[test]
    fn str_text_len_matches_encode_utf16(text in any::<String>()) {
        prop_assert_eq!(LlmRequest::new().user(text.as_str()).text_len(), utf16(&text));
    }

    #[test]
    fn long_text_len_matches_encode_utf16(
        chars in prop::collection::vec(any::<char>(), 0..1_500),
        ascii_run in 0usize..600,
    ) {
        // Long strings (up to 6,000 bytes), mostly non-ASCII, after an ASCII run of any length.
        let text = format!("{}{}", xs(ascii_run), String::from_iter(chars));
        prop_assert_eq!(LlmRequest::new().user(text.as_str()).text_len(), utf16(&text));
        prop_assert_eq!(LlmRequest::new().system(text.as_str()).text_len(), utf16(&text));
    }
}

// ===== naive estimator =====

#[test]
fn naive_upstream_examples() {
    let naive = NaiveEstimator::new();
    assert_eq!(
        naive.estimate(&LlmRequest::new().user(xs(400))).unwrap(),
        TokenEstimate::new(100, 2048)
    );
    assert_eq!(
        naive.estimate(&LlmRequest::new().user(xs(401))).unwrap(),
        TokenEstimate::new(101, 2048)
    );
    assert_eq!(
        naive.estimate(&LlmRequest::new()).unwrap(),
        TokenEstimate::new(0, 2048)
    );
    assert_eq!(
        naive
            .estimate(&LlmRequest::new().user("abcd").system("12345678"))
            .unwrap()
            .input,
        3
    );
    assert_eq!(
        naive
            .estimate(&LlmRequest::new().user(xs(400)).max_tokens(0))
            .unwrap(),
        TokenEstimate::new(100, 0)
    );
    assert_eq!(NaiveEstimator::default(), NaiveEstimator::new());
    assert_eq!(DEFAULT_OUTPUT_CAP, 2048);

    // The model plays no part.
    assert_eq!(input_of(&naive, &request("gpt-4o", 400)), 100);
}

#[test]
fn naive_output_cap_applies_only_without_a_ceiling() {
    let capped = NaiveEstimator::new().output_cap(100);
    assert_eq!(
        capped.estimate(&LlmRequest::new()).unwrap(),
        TokenEstimate::new(0, 100)
    );
    assert_eq!(
        capped
            .estimate(&LlmRequest::new().max_tokens(5000))
            .unwrap()
            .max_output,
        5000
    );
    let mut newer = LlmRequest::new();
    newer.max_completion_tokens = Some(300);
    assert_eq!(capped.estimate(&newer).unwrap().max_output, 300);
}

#[test]
fn naive_adds_extra_input_tokens_and_ignores_opaque_blocks() {
    let naive = NaiveEstimator::new();
    assert_eq!(
        input_of(
            &naive,
            &LlmRequest::new().user(xs(401)).extra_input_tokens(10)
        ),
        111
    );
    assert_eq!(
        input_of(&naive, &LlmRequest::new().extra_input_tokens(7)),
        7
    );
    let multimodal = LlmRequest::new()
        .user(vec![
            ContentBlock::opaque("image"),
            ContentBlock::text(xs(9)),
            ContentBlock::opaque("document"),
        ])
        .system(vec![ContentBlock::opaque("image")]);
    assert_eq!(input_of(&naive, &multimodal), 3);
    // UTF-16 units, not bytes or chars: 3 emoji are 6 units -> 2 tokens.
    assert_eq!(
        input_of(
            &naive,
            &LlmRequest::new().user("\u{1F600}\u{1F600}\u{1F600}")
        ),
        2
    );
}

#[test]
fn naive_input_overflow_is_an_error_naming_the_parts() {
    let naive = NaiveEstimator::new();
    let err = naive
        .estimate(&LlmRequest::new().user(xs(8)).extra_input_tokens(u64::MAX))
        .unwrap_err();
    assert_eq!(
        err,
        RequestError::InputOverflow {
            text_tokens: 2,
            opaque_tokens: 0,
            extra_input_tokens: u64::MAX
        }
    );
    assert_eq!(
        err.to_string(),
        "estimated input (2 text tokens + 0 opaque-block tokens + 18446744073709551615 extra input tokens) does not fit in 64 bits"
    );
    // Exactly u64::MAX still fits as an input.
    assert_eq!(
        input_of(&naive, &LlmRequest::new().extra_input_tokens(u64::MAX)),
        u64::MAX
    );
}

// ===== model-aware estimator =====

/// The 22 families: prefix, a representative model, ratio.
const FAMILIES: [(&str, &str, f64); 22] = [
    ("claude-3-5-haiku", "claude-3-5-haiku-20241022", 3.8),
    ("claude-3-5-sonnet", "claude-3-5-sonnet-latest", 3.9),
    ("claude-3-opus", "claude-3-opus-20240229", 3.9),
    ("claude-3-sonnet", "claude-3-sonnet-20240229", 3.9),
    ("claude-3-haiku", "claude-3-haiku-20240307", 3.8),
    ("claude-sonnet-4", "claude-sonnet-4-20250514", 3.9),
    ("claude-opus-4", "claude-opus-4-20250514", 3.9),
    ("claude-haiku-4", "claude-haiku-4-0", 3.8),
    ("claude-sonnet-4-5", "claude-sonnet-4-5-20250929", 3.9),
    ("claude-opus-4-5", "claude-opus-4-5-20251101", 3.9),
    ("claude-haiku-4-5", "claude-haiku-4-5-20251001", 3.8),
    ("gpt-4o", "gpt-4o-2024-08-06", 3.7),
    ("gpt-4-turbo", "gpt-4-turbo-2024-04-09", 3.7),
    ("gpt-4.1", "gpt-4.1-nano", 3.7),
    ("gpt-4", "gpt-4-0613", 3.7),
    ("gpt-3.5", "gpt-3.5-turbo-0125", 3.8),
    ("o1", "o1-preview", 3.7),
    ("o3", "o3-pro", 3.7),
    ("o4-mini", "o4-mini-2025-04-16", 3.7),
    ("gemini-2.5", "gemini-2.5-pro", 3.8),
    ("gemini-2", "gemini-2.0-flash-lite", 3.8),
    ("gemini-1.5", "gemini-1.5-flash-8b", 3.8),
];

/// `ceil(380 / ratio)`: one prompt length that tells the four ratios apart.
fn tokens_of_380(ratio: f64) -> u64 {
    match ratio {
        3.7 => 103,
        3.8 => 100,
        3.9 => 98,
        4.0 => 95,
        other => panic!("no figure for ratio {other}"),
    }
}

#[test]
fn every_family_of_the_table_has_its_ratio() {
    let (unknown, hook) = recording_hook();
    let estimator = ModelAwareEstimator::builder()
        .on_unknown_model(hook)
        .build()
        .unwrap();
    for (prefix, model, ratio) in FAMILIES {
        assert_eq!(estimator.ratio_for(prefix), ratio, "{prefix}");
        assert_eq!(estimator.ratio_for(model), ratio, "{model}");
        assert_eq!(
            estimator.ratio_for(&model.to_uppercase()),
            ratio,
            "{model} in upper case"
        );
        assert_eq!(
            input_of(&estimator, &request(model, 380)),
            tokens_of_380(ratio),
            "{model}"
        );
    }
    assert!(seen(&unknown).is_empty(), "every family is known");
    assert_eq!(input_of(&estimator, &request("mistral-large", 380)), 95);
    assert_eq!(seen(&unknown), ["mistral-large"]);
}

#[test]
fn family_matching_examples_of_the_original() {
    let (unknown, hook) = recording_hook();
    let estimator = ModelAwareEstimator::builder()
        .on_unknown_model(hook)
        .build()
        .unwrap();
    let cases: [(&str, f64); 16] = [
        ("claude-3-7-sonnet-20250219", 4.0),
        ("claude-3-7-sonnet", 4.0),
        ("gpt-5", 4.0),
        ("gpt-5-mini", 4.0),
        ("o3-mini", 3.7),
        ("gpt-4o-mini", 3.7),
        ("gemini-2.0-flash", 3.8),
        ("claude-opus-4-1", 3.9),
        ("o4", 4.0),
        ("chatgpt-4o-latest", 4.0),
        ("GPT-4O", 3.7),
        ("Claude-Sonnet-4-5", 3.9),
        ("GEMINI-2.5-PRO", 3.8),
        ("O4-MINI", 3.7),
        ("o1", 3.7),
        ("", 4.0),
    ];
    for (model, ratio) in cases {
        assert_eq!(estimator.ratio_for(model), ratio, "{model:?}");
        assert_eq!(
            input_of(&estimator, &request(model, 380)),
            tokens_of_380(ratio),
            "{model:?}"
        );
    }
    // Unknown models reach the hook as given (not lowercased), once per lookup.
    let expected: Vec<String> = [
        "claude-3-7-sonnet-20250219",
        "claude-3-7-sonnet",
        "gpt-5",
        "gpt-5-mini",
        "o4",
        "chatgpt-4o-latest",
        "",
    ]
    .into_iter()
    .flat_map(|m| [m.to_owned(), m.to_owned()])
    .collect();
    assert_eq!(seen(&unknown), expected);
}

#[test]
fn test_pinned_numbers() {
    let estimator = plain();
    for (model, chars) in [
        ("claude-sonnet-4", 390),
        ("claude-3-haiku", 380),
        ("gpt-4o", 370),
        ("unknown-model", 400),
    ] {
        assert_eq!(
            estimator.estimate(&request(model, chars)).unwrap(),
            TokenEstimate::new(100, 2048),
            "{model}"
        );
        // One character more needs one token more.
        assert_eq!(input_of(&estimator, &request(model, chars + 1)), 101);
    }
}

#[test]
fn request_model_wins_over_default_model() {
    let (unknown, hook) = recording_hook();
    let estimator = ModelAwareEstimator::builder()
        .default_model("claude-sonnet-4")
        .on_unknown_model(hook)
        .build()
        .unwrap();
    // No model on the request: the default (3.9).
    assert_eq!(input_of(&estimator, &LlmRequest::new().user(xs(390))), 100);
    // The request's model (3.7): ceil(390 / 3.7) = 106.
    assert_eq!(input_of(&estimator, &request("gpt-4o", 390)), 106);
    // An empty request model is used as is: unknown, 4.0.
    assert_eq!(input_of(&estimator, &request("", 390)), 98);
    assert_eq!(seen(&unknown), [""]);
}

#[test]
fn no_model_at_all_is_the_unknown_empty_model() {
    let (unknown, hook) = recording_hook();
    let estimator = ModelAwareEstimator::builder()
        .on_unknown_model(hook)
        .build()
        .unwrap();
    assert_eq!(
        estimator
            .estimate(&LlmRequest::new().user(xs(400)))
            .unwrap(),
        TokenEstimate::new(100, 2048)
    );
    assert_eq!(seen(&unknown), [""]);

    // An unknown default model is reported under its own name.
    let (unknown, hook) = recording_hook();
    let estimator = ModelAwareEstimator::builder()
        .default_model("My-Deployment")
        .on_unknown_model(hook)
        .build()
        .unwrap();
    estimator.estimate(&LlmRequest::new()).unwrap();
    assert_eq!(seen(&unknown), ["My-Deployment"]);
}

#[test]
fn overrides_match_exactly_then_lowercased_and_beat_the_table() {
    let (unknown, hook) = recording_hook();
    let estimator = ModelAwareEstimator::builder()
        .ratio("Mixed-Case", 2.0)
        .ratio("my-azure-gpt", 3.5)
        .ratio("gpt-4o", 1.0)
        .ratio("claude", 2.5)
        .on_unknown_model(hook)
        .build()
        .unwrap();
    // Exact key.
    assert_eq!(estimator.ratio_for("Mixed-Case"), 2.0);
    // The model is lowercased for the second lookup, the keys are not.
    assert_eq!(estimator.ratio_for("MY-AZURE-GPT"), 3.5);
    assert_eq!(estimator.ratio_for("My-Azure-Gpt"), 3.5);
    assert_eq!(estimator.ratio_for("mixed-case"), 4.0);
    assert_eq!(estimator.ratio_for("MIXED-CASE"), 4.0);
    // An override beats the table, and covers its own name only (not a prefix).
    assert_eq!(estimator.ratio_for("gpt-4o"), 1.0);
    assert_eq!(estimator.ratio_for("GPT-4o"), 1.0);
    assert_eq!(estimator.ratio_for("gpt-4o-mini"), 3.7);
    assert_eq!(estimator.ratio_for("claude-3-opus"), 3.9);
    assert_eq!(estimator.ratio_for("claude-x"), 4.0);
    assert_eq!(seen(&unknown), ["mixed-case", "MIXED-CASE", "claude-x"]);

    // The ratios drive the estimate: ceil(7 / 3.5) = 2, ceil(5 / 2.0) = 3, 37 / 1.0 = 37.
    assert_eq!(input_of(&estimator, &request("MY-AZURE-GPT", 7)), 2);
    assert_eq!(input_of(&estimator, &request("Mixed-Case", 5)), 3);
    assert_eq!(input_of(&estimator, &request("gpt-4o", 37)), 37);
    // And the default model goes through the same lookup.
    let by_default = ModelAwareEstimator::builder()
        .ratio("house-model", 2.0)
        .default_model("House-Model")
        .build()
        .unwrap();
    assert_eq!(input_of(&by_default, &LlmRequest::new().user(xs(9))), 5);
}

#[test]
fn invalid_override_ratios_are_refused_when_built() {
    for (ratio, shown) in [
        (0.0, "0"),
        (-0.0, "-0"),
        (-1.0, "-1"),
        (-0.5, "-0.5"),
        (f64::INFINITY, "inf"),
        (f64::NEG_INFINITY, "-inf"),
        (f64::NAN, "NaN"),
    ] {
        let err = ModelAwareEstimator::builder()
            .ratio("good", 3.0)
            .ratio("my-model", ratio)
            .build()
            .unwrap_err();
        match &err {
            EstimatorError::InvalidRatio { model, ratio: got } => {
                assert_eq!(model, "my-model");
                assert_eq!(
                    got.to_bits(),
                    ratio.to_bits(),
                    "the refused value, as given"
                );
            }
            other => panic!("expected InvalidRatio, got {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            format!("ratio override for \"my-model\" must be a finite number > 0 (got {shown})")
        );
    }
    // The first invalid override (in the order given) is reported.
    let err = ModelAwareEstimator::builder()
        .ratio("a", 1.0)
        .ratio("b", -2.0)
        .ratio("c", 0.0)
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        EstimatorError::InvalidRatio {
            model: "b".into(),
            ratio: -2.0
        }
    );
    // Tiny and huge finite ratios are valid.
    let tiny = ModelAwareEstimator::builder()
        .ratio("tiny", 0.5)
        .ratio("huge", 1e300)
        .build()
        .unwrap();
    assert_eq!(input_of(&tiny, &request("tiny", 3)), 6);
    assert_eq!(input_of(&tiny, &request("huge", 3)), 1);
}

#[test]
fn unknown_model_hook_fires_on_every_call() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let estimator = ModelAwareEstimator::builder()
        .on_unknown_model(move |_| {
            counter.fetch_add(1, Ordering::SeqCst);
        })
        .build()
        .unwrap();
    for i in 1..=5 {
        estimator.estimate(&request("gpt-5", 40)).unwrap();
        assert_eq!(
            calls.load(Ordering::SeqCst),
            i,
            "no caching of unknown models"
        );
    }
    for _ in 0..5 {
        estimator.estimate(&request("gpt-4o", 40)).unwrap();
    }
    assert_eq!(calls.load(Ordering::SeqCst), 5, "known models do not fire");
    assert_eq!(estimator.ratio_for("gpt-5"), 4.0);
    assert_eq!(calls.load(Ordering::SeqCst), 6);
}

#[test]
fn unknown_model_hook_fires_before_the_estimate_fails() {
    let (unknown, hook) = recording_hook();
    let estimator = ModelAwareEstimator::builder()
        .on_unknown_model(hook)
        .opaque_block_tokens(OpaqueBlockTokens::Each(u64::MAX))
        .build()
        .unwrap();
    let err = estimator
        .estimate(&request("mystery-1", 8).extra_input_tokens(u64::MAX))
        .unwrap_err();
    assert_eq!(
        err,
        RequestError::InputOverflow {
            text_tokens: 2,
            opaque_tokens: 0,
            extra_input_tokens: u64::MAX
        }
    );
    assert_eq!(seen(&unknown), ["mystery-1"]);

    // The surcharge alone overflowing is reported at its ceiling, also after the hook.
    let two_images = LlmRequest::new()
        .model("mystery-2")
        .user(vec![
            ContentBlock::opaque("image"),
            ContentBlock::opaque("image"),
        ])
        .extra_input_tokens(3);
    assert_eq!(
        estimator.estimate(&two_images).unwrap_err(),
        RequestError::InputOverflow {
            text_tokens: 0,
            opaque_tokens: u64::MAX,
            extra_input_tokens: 3
        }
    );
    assert_eq!(seen(&unknown), ["mystery-1", "mystery-2"]);
}

#[test]
fn opaque_block_surcharge_as_a_number() {
    // Upstream example: 39 chars at 3.9 + image + document at 2048 each -> 10 + 4096.
    let estimator = ModelAwareEstimator::builder()
        .default_model("claude-sonnet-4")
        .opaque_block_tokens(OpaqueBlockTokens::Each(2048))
        .build()
        .unwrap();
    let request = LlmRequest::new().user(vec![
        ContentBlock::text(xs(39)),
        ContentBlock::opaque("image"),
        ContentBlock::opaque("document"),
    ]);
    assert_eq!(
        estimator.estimate(&request).unwrap(),
        TokenEstimate::new(10 + 4096, 2048)
    );
    // Without a surcharge (the default) the blocks are free.
    let free = ModelAwareEstimator::builder()
        .default_model("claude-sonnet-4")
        .build()
        .unwrap();
    assert_eq!(input_of(&free, &request), 10);
    assert_eq!(
        input_of(
            &ModelAwareEstimator::builder()
                .default_model("claude-sonnet-4")
                .opaque_block_tokens(OpaqueBlockTokens::None)
                .build()
                .unwrap(),
            &request
        ),
        10
    );
    // String content and text blocks are never surcharged; extra input tokens add on top.
    let text_only = LlmRequest::new()
        .system("abc")
        .user(vec![ContentBlock::text("d")])
        .user("efgh")
        .extra_input_tokens(100);
    assert_eq!(input_of(&estimator, &text_only), 3 + 100);
}

#[test]
fn opaque_block_surcharge_by_type_with_and_without_default() {
    let by_type = OpaqueBlockTokens::by_type(Some(100), [("image", 1500), ("document", 800)]);
    assert_eq!(by_type.cost("image"), 1500);
    assert_eq!(by_type.cost("document"), 800);
    assert_eq!(by_type.cost("tool_result"), 100);
    assert_eq!(by_type.cost(""), 100);
    assert_eq!(
        by_type.cost("Image"),
        100,
        "block types are matched exactly"
    );
    let no_default = OpaqueBlockTokens::by_type(None, [("image", 1500)]);
    assert_eq!(no_default.cost("document"), 0);
    assert_eq!(OpaqueBlockTokens::Each(7).cost("anything"), 7);
    assert_eq!(OpaqueBlockTokens::None.cost("image"), 0);
    assert_eq!(OpaqueBlockTokens::default(), OpaqueBlockTokens::None);

    let request = LlmRequest::new()
        .model("gpt-4o")
        .user(vec![
            ContentBlock::text(xs(37)),
            ContentBlock::opaque("image"),
            ContentBlock::opaque("tool_result"),
        ])
        .user(vec![
            ContentBlock::opaque("document"),
            ContentBlock::opaque("image"),
        ]);
    let with_default = ModelAwareEstimator::builder()
        .opaque_block_tokens(by_type)
        .build()
        .unwrap();
    assert_eq!(
        input_of(&with_default, &request),
        10 + 1500 + 100 + 800 + 1500
    );
    let without_default = ModelAwareEstimator::builder()
        .opaque_block_tokens(no_default)
        .build()
        .unwrap();
    assert_eq!(input_of(&without_default, &request), 10 + 1500 + 1500);
}

#[test]
fn malformed_text_blocks_and_system_blocks_are_surcharged() {
    let body = json!({
        "model": "claude-sonnet-4",
        "system": [
            {"type": "text", "text": xs(39)},
            {"type": "image", "source": {"type": "base64", "data": "AA=="}}
        ],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": 123},
            {"type": "document", "source": {"type": "text", "data": "..."}}
        ]}]
    });
    let request = parse(&body);
    assert_eq!(request.text_len(), 39);
    let typed = ModelAwareEstimator::builder()
        .opaque_block_tokens(OpaqueBlockTokens::by_type(
            Some(1),
            [("text", 7), ("image", 1000)],
        ))
        .build()
        .unwrap();
    // 39 chars at 3.9 = 10; the malformed text block costs the "text" figure (7), the
    // document the default (1), the system image 1000.
    assert_eq!(input_of(&typed, &request), 10 + 7 + 1 + 1000);
    let each = ModelAwareEstimator::builder()
        .opaque_block_tokens(OpaqueBlockTokens::Each(2048))
        .build()
        .unwrap();
    assert_eq!(input_of(&each, &request), 10 + 3 * 2048);
}

#[test]
fn a_tiny_ratio_makes_the_text_too_large() {
    let estimator = ModelAwareEstimator::builder()
        .ratio("tiny", 1e-300)
        .build()
        .unwrap();
    let err = estimator.estimate(&request("tiny", 1)).unwrap_err();
    assert_eq!(err, RequestError::TextTooLarge { chars: 1 });
    assert_eq!(
        err.to_string(),
        "estimated input for 1 characters does not fit in 64 bits"
    );
    // No text is no tokens, whatever the ratio.
    assert_eq!(input_of(&estimator, &request("tiny", 0)), 0);
}

#[test]
fn model_aware_output_is_the_ceiling_or_the_cap() {
    let estimator = ModelAwareEstimator::builder()
        .output_cap(64)
        .build()
        .unwrap();
    assert_eq!(
        estimator.estimate(&request("gpt-4o", 370)).unwrap(),
        TokenEstimate::new(100, 64)
    );
    assert_eq!(
        estimator
            .estimate(&request("gpt-4o", 370).max_tokens(10))
            .unwrap()
            .max_output,
        10
    );
    let mut newer = request("gpt-4o", 370);
    newer.max_completion_tokens = Some(20);
    assert_eq!(estimator.estimate(&newer).unwrap().max_output, 20);
    assert_eq!(
        plain().estimate(&LlmRequest::new()).unwrap().max_output,
        DEFAULT_OUTPUT_CAP
    );
    // Extra input tokens are added after the ratio: ceil(370 / 3.7) + 5.
    assert_eq!(
        input_of(&estimator, &request("gpt-4o", 370).extra_input_tokens(5)),
        105
    );
}

// ===== adaptive estimator =====

#[test]
fn adaptive_upstream_example_three_observations() {
    let a = adaptive(1.0, 3, (0.5, 2.0), 64);
    let req = request("gpt-4o", 370).max_tokens(10); // base input 100
    for n in 1..=2 {
        a.observe_request(&req, usage(150, 5)).unwrap();
        let early = a.estimate(&req).unwrap();
        assert_eq!(
            (early.input, early.max_output),
            (100, 10),
            "not corrected before min_samples"
        );
        let c = a.corrections();
        assert_eq!((c[0].samples, c[0].factor, c[0].applied), (n, 1.5, 1.0));
    }
    a.observe_request(&req, usage(150, 5)).unwrap();
    let corrected = a.estimate(&req).unwrap();
    assert_eq!((corrected.input, corrected.max_output), (150, 10));
    assert_eq!(
        a.corrections(),
        vec![Correction {
            model: "gpt-4o".into(),
            samples: 3,
            factor: 1.5,
            applied: 1.5
        }]
    );
}

#[test]
fn adaptive_upstream_clamp_examples() {
    let a = adaptive(1.0, 1, (0.8, 1.5), 64);
    let req = request("gpt-4o", 370); // base input 100
    a.observe_request(&req, usage(1000, 0)).unwrap();
    assert_eq!(a.estimate(&req).unwrap().input, 150);
    assert_eq!(
        a.corrections(),
        vec![Correction {
            model: "gpt-4o".into(),
            samples: 1,
            factor: 10.0,
            applied: 1.5
        }]
    );
    a.reset(None);
    a.observe_request(&req, usage(1, 0)).unwrap();
    assert_eq!(a.estimate(&req).unwrap().input, 80);
    assert_eq!(
        a.corrections(),
        vec![Correction {
            model: "gpt-4o".into(),
            samples: 1,
            factor: 0.01,
            applied: 0.8
        }]
    );
}

#[test]
fn adaptive_ewma_with_the_default_options() {
    // Defaults: smoothing 0.2, min_samples 5, clamp [0.5, 2].
    let a = AdaptiveEstimator::builder(plain()).build().unwrap();
    let req = request("claude-sonnet-4", 390); // base input 100
    let observed = [
        130u64, 90, 150, 210, 120, 100, 400, 20, 20, 20, 20, 20, 20, 20, 20, 20, 20,
    ];
    let mut factor = 0.0f64;
    for (i, &input) in observed.iter().enumerate() {
        a.observe_request(&req, usage(input, 1)).unwrap();
        let ratio = input as f64 / 100.0;
        if i == 0 {
            factor = ratio; // the first sample initialises the average
        } else {
            factor += 0.2 * (ratio - factor);
        }
        let samples = i as u64 + 1;
        let applied = if samples < 5 {
            1.0
        } else {
            factor.clamp(0.5, 2.0)
        };
        assert_eq!(
            a.corrections(),
            vec![Correction {
                model: "claude-sonnet-4".into(),
                samples,
                factor,
                applied
            }],
            "after {samples} samples"
        );
        let expected = if applied == 1.0 {
            100
        } else {
            (100.0 * applied).ceil() as u64
        };
        assert_eq!(
            a.estimate(&req).unwrap().input,
            expected,
            "after {samples} samples"
        );
    }
    // The long run of 0.2x drove the average under the clamp floor.
    let last = &a.corrections()[0];
    assert!(last.factor < 0.5 && last.applied == 0.5, "{last:?}");
    assert_eq!(a.estimate(&req).unwrap().input, 50);
}

#[test]
fn adaptive_never_corrects_the_output() {
    let base = ModelAwareEstimator::builder()
        .output_cap(64)
        .build()
        .unwrap();
    let a = AdaptiveEstimator::builder(base)
        .smoothing(1.0)
        .min_samples(1)
        .build()
        .unwrap();
    a.observe_request(&request("gpt-4o", 370), usage(200, 5000))
        .unwrap();
    let uncapped = a.estimate(&request("gpt-4o", 370)).unwrap();
    assert_eq!((uncapped.input, uncapped.max_output), (200, 64));
    let capped = a.estimate(&request("gpt-4o", 370).max_tokens(77)).unwrap();
    assert_eq!((capped.input, capped.max_output), (200, 77));
}

#[test]
fn adaptive_scales_extra_input_and_opaque_surcharge() {
    let base = ModelAwareEstimator::builder()
        .opaque_block_tokens(OpaqueBlockTokens::Each(10))
        .build()
        .unwrap();
    let a = AdaptiveEstimator::builder(base)
        .smoothing(1.0)
        .min_samples(1)
        .build()
        .unwrap();
    a.observe_request(&request("gpt-4o", 370), usage(150, 0))
        .unwrap(); // factor 1.5
    // Base: 100 text + 2 x 10 opaque + 31 extra = 151; corrected ceil(151 x 1.5) = 227.
    let rich = LlmRequest::new()
        .model("gpt-4o")
        .user(vec![
            ContentBlock::text(xs(370)),
            ContentBlock::opaque("image"),
            ContentBlock::opaque("document"),
        ])
        .extra_input_tokens(31);
    assert_eq!(a.estimate(&rich).unwrap().input, 227);
    // Extra input alone is scaled too: ceil(7 x 1.5) = 11.
    let extra_only = LlmRequest::new().model("gpt-4o").extra_input_tokens(7);
    assert_eq!(a.estimate(&extra_only).unwrap().input, 11);
}

#[test]
fn adaptive_observes_against_the_uncorrected_base() {
    let a = adaptive(0.5, 1, (0.1, 10.0), 8);
    let req = request("gpt-4o", 370); // base input 100
    a.observe_request(&req, usage(200, 0)).unwrap();
    let corrected = a.estimate(&req).unwrap();
    assert_eq!(corrected.input, 200);
    // Against the base, 200 is 2x again; against the corrected 200 it would be 1x and pull
    // the average to 1.5.
    a.observe_request(&req, usage(200, 0)).unwrap();
    assert_eq!(a.corrections()[0].factor, 2.0);
    // The estimate handed back (as the bulkhead does) measures against the base as well.
    a.observe(&corrected, usage(200, 0));
    let c = a.corrections();
    assert_eq!((c[0].samples, c[0].factor), (3, 2.0));
    assert_eq!(a.estimate(&req).unwrap().input, 200, "no compounding");
    // And a real change moves it by the smoothing: 2 + 0.5 x (3 - 2).
    a.observe(&a.estimate(&req).unwrap(), usage(300, 0));
    assert_eq!(a.corrections()[0].factor, 2.5);
    assert_eq!(a.estimate(&req).unwrap().input, 250);
}

#[test]
fn adaptive_keys_models_lowercased() {
    let a = adaptive(1.0, 1, (0.5, 2.0), 8);
    a.observe_request(&request("GPT-4o", 370), usage(130, 0))
        .unwrap();
    a.observe_request(&request("gpt-4O", 370), usage(130, 0))
        .unwrap();
    let c = a.corrections();
    assert_eq!(c.len(), 1);
    assert_eq!((c[0].model.as_str(), c[0].samples), ("gpt-4o", 2));
    assert_eq!(a.estimate(&request("Gpt-4o", 370)).unwrap().input, 130);
    assert_eq!(a.estimate(&request("gpt-4o-mini", 370)).unwrap().input, 100);
}

#[test]
fn adaptive_uses_the_default_model_and_else_the_empty_key() {
    let base = ModelAwareEstimator::builder()
        .default_model("Claude-Sonnet-4")
        .build()
        .unwrap();
    let a = AdaptiveEstimator::builder(base)
        .smoothing(1.0)
        .min_samples(1)
        .build()
        .unwrap();
    let unnamed = LlmRequest::new().user(xs(390)); // base input 100 at 3.9
    a.observe_request(&unnamed, usage(120, 0)).unwrap();
    assert_eq!(models(&a), ["claude-sonnet-4"]);
    assert_eq!(a.estimate(&unnamed).unwrap().input, 120);
    assert_eq!(
        a.estimate(&request("claude-sonnet-4", 390)).unwrap().input,
        120
    );
    assert_eq!(a.estimate(&request("gpt-4o", 370)).unwrap().input, 100);

    let a = adaptive(1.0, 1, (0.5, 2.0), 8);
    let nameless = LlmRequest::new().user(xs(400)); // unknown "": 4.0
    a.observe_request(&nameless, usage(180, 0)).unwrap();
    assert_eq!(
        a.corrections(),
        vec![Correction {
            model: String::new(),
            samples: 1,
            factor: 1.8,
            applied: 1.8
        }]
    );
    assert_eq!(a.estimate(&nameless).unwrap().input, 180);
    assert_eq!(a.estimate(&request("", 400)).unwrap().input, 180);
}

#[test]
fn adaptive_ignores_observations_of_a_zero_base_input() {
    let a = adaptive(1.0, 1, (0.5, 2.0), 8);
    let empty = LlmRequest::new().model("gpt-4o").max_tokens(50);
    a.observe_request(&empty, usage(500, 10)).unwrap();
    assert!(a.corrections().is_empty(), "no state created");
    let estimate = a.estimate(&empty).unwrap();
    assert_eq!((estimate.input, estimate.max_output), (0, 50));
    a.observe(&estimate, usage(500, 10));
    assert!(a.corrections().is_empty(), "no state created");
    // An estimate that was never the adaptive one's is ignored as well.
    a.observe(&TokenEstimate::new(100, 10), usage(500, 10));
    assert!(a.corrections().is_empty());
}

#[test]
fn adaptive_estimates_alone_create_no_correction() {
    let a = adaptive(1.0, 1, (0.5, 2.0), 2);
    for model in ["a", "b", "c", "d"] {
        assert_eq!(a.estimate(&request(model, 400)).unwrap().input, 100);
    }
    assert!(a.corrections().is_empty());
    let memo = a.estimate(&request("e", 400)).unwrap();
    a.observe(&memo, usage(150, 0));
    assert_eq!(models(&a), ["e"]);
}

#[test]
fn adaptive_evicts_the_oldest_inserted_model() {
    let a = adaptive(1.0, 1, (0.1, 10.0), 2);
    a.observe_request(&request("a", 400), usage(110, 0))
        .unwrap();
    a.observe_request(&request("b", 400), usage(120, 0))
        .unwrap();
    // Updating "a" does not refresh its place: it is still the oldest.
    a.observe_request(&request("a", 400), usage(130, 0))
        .unwrap();
    assert_eq!(models(&a), ["a", "b"]);
    a.observe_request(&request("c", 400), usage(140, 0))
        .unwrap();
    assert_eq!(
        a.corrections(),
        vec![
            Correction {
                model: "b".into(),
                samples: 1,
                factor: 1.2,
                applied: 1.2
            },
            Correction {
                model: "c".into(),
                samples: 1,
                factor: 1.4,
                applied: 1.4
            },
        ]
    );
    assert_eq!(
        a.estimate(&request("a", 400)).unwrap().input,
        100,
        "forgotten"
    );
    assert_eq!(a.estimate(&request("b", 400)).unwrap().input, 120);
    // "a" comes back as a new model, with one sample, and evicts "b".
    a.observe_request(&request("A", 400), usage(150, 0))
        .unwrap();
    assert_eq!(models(&a), ["c", "a"]);
    assert_eq!(a.corrections()[1].samples, 1);
    assert_eq!(a.estimate(&request("b", 400)).unwrap().input, 100);

    // With room for one model, each new model replaces the last.
    let one = adaptive(1.0, 1, (0.1, 10.0), 1);
    for model in ["x", "y", "z"] {
        one.observe_request(&request(model, 400), usage(200, 0))
            .unwrap();
        assert_eq!(models(&one), [model]);
    }
}

#[test]
fn adaptive_reset_one_model_case_insensitively_or_all() {
    let a = adaptive(1.0, 1, (0.1, 10.0), 8);
    for (model, input) in [("gpt-4o", 150), ("claude-sonnet-4", 120), ("gemini-2", 90)] {
        let chars = match model {
            "gpt-4o" => 370,
            "claude-sonnet-4" => 390,
            _ => 380,
        };
        a.observe_request(&request(model, chars), usage(input, 0))
            .unwrap();
    }
    a.reset(Some("GPT-4O"));
    assert_eq!(models(&a), ["claude-sonnet-4", "gemini-2"]);
    assert_eq!(a.estimate(&request("gpt-4o", 370)).unwrap().input, 100);
    a.reset(Some("not-tracked"));
    assert_eq!(models(&a), ["claude-sonnet-4", "gemini-2"]);
    assert_eq!(
        a.estimate(&request("claude-sonnet-4", 390)).unwrap().input,
        120
    );
    // Observing after a reset starts over.
    a.observe_request(&request("gpt-4o", 370), usage(110, 0))
        .unwrap();
    assert_eq!(models(&a), ["claude-sonnet-4", "gemini-2", "gpt-4o"]);
    assert_eq!(a.corrections()[2].samples, 1);
    assert_eq!(a.corrections()[2].factor, 1.1);

    a.reset(None);
    assert!(a.corrections().is_empty());
    for (model, chars) in [("gpt-4o", 370), ("claude-sonnet-4", 390), ("gemini-2", 380)] {
        assert_eq!(
            a.estimate(&request(model, chars)).unwrap().input,
            100,
            "{model}"
        );
    }
    // A release whose estimate was taken before a reset still reports its model, like
    // upstream's `observe(request, usage)`: the model starts over from that observation.
    let before = a.estimate(&request("gpt-4o", 370)).unwrap();
    a.reset(None);
    a.observe(&before, usage(200, 0));
    assert_eq!(models(&a), ["gpt-4o"]);
    assert_eq!(
        (a.corrections()[0].samples, a.corrections()[0].factor),
        (1, 2.0)
    );
}

#[test]
fn adaptive_option_validation_errors() {
    let build = |f: fn(AdaptiveEstimatorBuilder) -> AdaptiveEstimatorBuilder| {
        f(AdaptiveEstimator::builder(plain())).build().unwrap_err()
    };
    let cases: [(EstimatorError, &str); 14] = [
        (
            build(|b| b.smoothing(0.0)),
            "smoothing must be a finite number in (0, 1] (got 0)",
        ),
        (
            build(|b| b.smoothing(1.5)),
            "smoothing must be a finite number in (0, 1] (got 1.5)",
        ),
        (
            build(|b| b.smoothing(f64::NAN)),
            "smoothing must be a finite number in (0, 1] (got NaN)",
        ),
        (
            build(|b| b.smoothing(-0.2)),
            "smoothing must be a finite number in (0, 1] (got -0.2)",
        ),
        (
            build(|b| b.smoothing(f64::INFINITY)),
            "smoothing must be a finite number in (0, 1] (got inf)",
        ),
        (
            build(|b| b.min_samples(0)),
            "min_samples must be a positive integer (got 0)",
        ),
        (
            build(|b| b.min_correction(0.0)),
            "min_correction must be a finite number > 0 (got 0)",
        ),
        (
            build(|b| b.min_correction(-1.0)),
            "min_correction must be a finite number > 0 (got -1)",
        ),
        (
            build(|b| b.min_correction(f64::INFINITY)),
            "min_correction must be a finite number > 0 (got inf)",
        ),
        (
            build(|b| b.min_correction(2.0).max_correction(1.0)),
            "max_correction must be a finite number >= min_correction (2) (got 1)",
        ),
        (
            build(|b| b.max_correction(0.4)),
            "max_correction must be a finite number >= min_correction (0.5) (got 0.4)",
        ),
        (
            build(|b| b.max_correction(f64::INFINITY)),
            "max_correction must be a finite number >= min_correction (0.5) (got inf)",
        ),
        (
            build(|b| b.max_correction(f64::NAN)),
            "max_correction must be a finite number >= min_correction (0.5) (got NaN)",
        ),
        (
            build(|b| b.max_models(0)),
            "max_models must be a positive integer (got 0)",
        ),
    ];
    for (err, message) in &cases {
        assert_eq!(err.to_string(), *message);
    }
    // The typed values.
    assert_eq!(cases[0].0, EstimatorError::Smoothing { value: 0.0 });
    assert_eq!(cases[1].0, EstimatorError::Smoothing { value: 1.5 });
    assert!(matches!(cases[2].0, EstimatorError::Smoothing { value } if value.is_nan()));
    assert_eq!(cases[5].0, EstimatorError::MinSamples { value: 0 });
    assert_eq!(cases[7].0, EstimatorError::MinCorrection { value: -1.0 });
    assert_eq!(
        cases[9].0,
        EstimatorError::MaxCorrection {
            value: 1.0,
            min: 2.0
        }
    );
    assert_eq!(
        cases[11].0,
        EstimatorError::MaxCorrection {
            value: f64::INFINITY,
            min: 0.5
        }
    );
    assert_eq!(cases[13].0, EstimatorError::MaxModels { value: 0 });

    // Boundaries that are valid.
    let edge = AdaptiveEstimator::builder(plain())
        .smoothing(1.0)
        .min_samples(1)
        .min_correction(1e-9)
        .max_correction(1e-9)
        .max_models(1)
        .build();
    assert!(edge.is_ok());
    let equal = AdaptiveEstimator::builder(plain())
        .min_correction(1.0)
        .max_correction(1.0)
        .smoothing(f64::MIN_POSITIVE)
        .build();
    assert!(equal.is_ok());
}

#[test]
fn adaptive_options_are_validated_in_the_documented_order() {
    let all_bad = || {
        AdaptiveEstimator::builder(plain())
            .smoothing(f64::NAN)
            .min_samples(0)
            .min_correction(0.0)
            .max_correction(f64::INFINITY)
            .max_models(0)
    };
    assert!(matches!(
        all_bad().build().unwrap_err(),
        EstimatorError::Smoothing { value } if value.is_nan()
    ));
    assert_eq!(
        all_bad().smoothing(0.5).build().unwrap_err(),
        EstimatorError::MinSamples { value: 0 }
    );
    assert_eq!(
        all_bad().smoothing(0.5).min_samples(2).build().unwrap_err(),
        EstimatorError::MinCorrection { value: 0.0 }
    );
    assert_eq!(
        all_bad()
            .smoothing(0.5)
            .min_samples(2)
            .min_correction(0.7)
            .build()
            .unwrap_err(),
        EstimatorError::MaxCorrection {
            value: f64::INFINITY,
            min: 0.7
        }
    );
    assert_eq!(
        all_bad()
            .smoothing(0.5)
            .min_samples(2)
            .min_correction(0.7)
            .max_correction(0.7)
            .build()
            .unwrap_err(),
        EstimatorError::MaxModels { value: 0 }
    );
    assert!(
        all_bad()
            .smoothing(0.5)
            .min_samples(2)
            .min_correction(0.7)
            .max_correction(0.7)
            .max_models(3)
            .build()
            .is_ok()
    );
    // The order of the setter calls does not matter.
    let reversed = AdaptiveEstimator::builder(plain())
        .max_models(0)
        .max_correction(-1.0)
        .min_correction(-1.0)
        .min_samples(0)
        .smoothing(2.0)
        .build()
        .unwrap_err();
    assert_eq!(reversed, EstimatorError::Smoothing { value: 2.0 });
}

#[test]
fn adaptive_base_hook_fires_on_estimates_and_hand_observations() {
    let (unknown, hook) = recording_hook();
    let base = ModelAwareEstimator::builder()
        .on_unknown_model(hook)
        .build()
        .unwrap();
    let a = AdaptiveEstimator::builder(base)
        .smoothing(1.0)
        .min_samples(1)
        .build()
        .unwrap();
    a.observe_request(&request("Mystery", 400), usage(150, 0))
        .unwrap();
    assert_eq!(seen(&unknown), ["Mystery"]);
    assert_eq!(a.estimate(&request("MYSTERY", 400)).unwrap().input, 150);
    assert_eq!(seen(&unknown), ["Mystery", "MYSTERY"]);
}

#[test]
fn adaptive_correction_of_a_huge_estimate_is_an_error() {
    let a = adaptive(1.0, 1, (0.5, 2.0), 8);
    a.observe_request(&request("m", 400), usage(200, 0))
        .unwrap(); // factor 2
    let huge = request("m", 400).extra_input_tokens(u64::MAX - 100); // base u64::MAX
    assert_eq!(
        a.estimate(&huge).unwrap_err(),
        RequestError::TextTooLarge { chars: 400 }
    );
    // The same request uncorrected fits.
    assert_eq!(input_of(&plain(), &huge), u64::MAX);
}

// ===== bulkhead integration =====

#[test]
fn default_estimator_is_model_aware_seeded_with_model_and_output_cap() {
    let bulkhead = LlmBulkhead::builder("gpt-4o", 4)
        .token_budget(TokenBudget::new(100_000).output_cap(64))
        .build()
        .unwrap();
    let req = LlmRequest::new().user(xs(370));
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(100, 64)));
    assert_eq!(
        bulkhead.estimate(&req.clone().max_tokens(10)).unwrap(),
        Some(res(100, 10))
    );
    let mut newer = req.clone();
    newer.max_completion_tokens = Some(30);
    assert_eq!(bulkhead.estimate(&newer).unwrap(), Some(res(100, 30)));
    // Opaque blocks cost nothing by default; extra input tokens count.
    let multimodal = LlmRequest::new()
        .user(vec![
            ContentBlock::text(xs(370)),
            ContentBlock::opaque("image"),
        ])
        .extra_input_tokens(9);
    assert_eq!(bulkhead.estimate(&multimodal).unwrap(), Some(res(109, 64)));

    // Default output cap 2048; an unknown bulkhead model falls back to 4.0.
    let unknown = budgeted("my-model");
    assert_eq!(
        unknown.estimate(&LlmRequest::new().user(xs(370))).unwrap(),
        Some(res(93, 2048))
    );
    // Without a token budget nothing is estimated.
    let unbudgeted = LlmBulkhead::builder("gpt-4o", 4).build().unwrap();
    assert_eq!(unbudgeted.estimate(&req).unwrap(), None);
    let permit = unbudgeted.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!((permit.reservation(), permit.held_tokens()), (None, 0));
}

#[test]
fn request_model_wins_over_bulkhead_model() {
    let bulkhead = budgeted("gpt-4o");
    // 390 chars: 106 at gpt-4o's 3.7, 100 at claude-sonnet-4's 3.9, 98 at the fallback 4.0.
    assert_eq!(
        bulkhead.estimate(&LlmRequest::new().user(xs(390))).unwrap(),
        Some(res(106, 2048))
    );
    assert_eq!(
        bulkhead.estimate(&request("claude-sonnet-4", 390)).unwrap(),
        Some(res(100, 2048))
    );
    assert_eq!(
        bulkhead.estimate(&request("", 390)).unwrap(),
        Some(res(98, 2048)),
        "an empty request model is used as is"
    );
    let permit = bulkhead
        .try_acquire(&request("claude-sonnet-4", 390), AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(100, 2048)));
}

#[test]
fn estimate_permit_and_would_admit_agree() {
    let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 8)
        .token_budget(TokenBudget::new(100_000).output_cap(512))
        .build()
        .unwrap();
    let requests = [
        LlmRequest::new().user(xs(390)),
        request("gpt-4o-mini", 1_000).max_tokens(100),
        request("gemini-2.5-flash", 7).extra_input_tokens(40),
        LlmRequest::new().system("日本語").user("\u{1F600}"),
        parse(&openai_body()),
        parse(&anthropic_body()),
    ];
    let expected = [
        res(100, 512),
        res(271, 100),
        res(42, 512),
        res(2, 512),
        res(33, 512),
        res(27, 1024),
    ];
    for (req, want) in requests.iter().zip(expected) {
        let preview = bulkhead.estimate(req).unwrap().unwrap();
        assert_eq!(preview, want);
        let (verdict, detail) = bulkhead
            .would_admit_with_detail(req, AcquireOptions::new())
            .unwrap();
        assert_eq!(verdict, Verdict::Admit);
        assert_eq!(detail.token_budget.unwrap().requested, preview.reserved());
        let permit = bulkhead.try_acquire(req, AcquireOptions::new()).unwrap();
        assert_eq!(permit.reservation(), Some(preview));
        assert_eq!(permit.held_tokens(), preview.reserved());
    }
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn estimate_round_trips_as_the_reservation_override() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let bulkhead = budgeted_with(move |r: &LlmRequest| {
        counter.fetch_add(1, Ordering::SeqCst);
        TokenEstimate::new(r.text_len().div_ceil(3), r.output_ceiling().unwrap_or(700))
    });
    let req = LlmRequest::new().user(xs(301));
    let preview = bulkhead.estimate(&req).unwrap().unwrap();
    assert_eq!(preview, res(101, 700));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "estimate() calls the estimator once"
    );

    let with_preview = AcquireOptions::new().reservation(preview);
    let (_, detail) = bulkhead
        .would_admit_with_detail(&req, with_preview)
        .unwrap();
    assert_eq!(detail.token_budget.unwrap().requested, 801);
    let permit = bulkhead.try_acquire(&req, with_preview).unwrap();
    assert_eq!(permit.reservation(), Some(preview));
    assert_eq!(permit.held_tokens(), 801);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "an override is not estimated"
    );
    drop(permit);

    // Without an override, each admission estimates exactly once.
    let permit = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!(permit.reservation(), Some(preview));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // The override is taken as is, even when the request says otherwise.
    let other = AcquireOptions::new().reservation(res(5, 6));
    let small = bulkhead.try_acquire(&req, other).unwrap();
    assert_eq!(small.reservation(), Some(res(5, 6)));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn custom_closure_estimator_sizes_admissions() {
    let bulkhead = budgeted_with(|r: &LlmRequest| TokenEstimate::new(r.text_len() / 3, 500));
    let req = LlmRequest::new().model("gpt-4o").user(xs(300));
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(100, 500)));
    let permit = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!(permit.reservation(), Some(res(100, 500)));
    // The naive estimator as a bulkhead's estimator.
    let naive = budgeted_with(NaiveEstimator::new().output_cap(100));
    assert_eq!(
        naive.estimate(&request("claude-sonnet-4", 390)).unwrap(),
        Some(res(98, 100))
    );
}

#[test]
fn estimator_output_overflow_is_invalid_and_counts_nothing() {
    let bulkhead = LlmBulkhead::builder("gpt-4o", 2)
        .max_queue(2)
        .token_budget(TokenBudget::new(100_000))
        .estimator(|_: &LlmRequest| TokenEstimate::new(u64::MAX, 1))
        .build()
        .unwrap();
    let req = request("gpt-4o", 10);
    let overflow = RequestError::ReservationOverflow {
        input: u64::MAX,
        max_output: 1,
    };
    assert_eq!(bulkhead.estimate(&req), Err(overflow));
    assert_eq!(
        bulkhead.would_admit(&req, AcquireOptions::new()),
        Err(overflow)
    );
    let err = bulkhead
        .try_acquire(&req, AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err, AcquireError::Invalid(overflow));
    assert_eq!(
        err.to_string(),
        "invalid request: token reservation (18446744073709551615 input + 1 max output) does not fit in 64 bits"
    );
    assert!(err.rejection().is_none());
    assert_eq!(
        bulkhead
            .try_acquire_owned(&req, AcquireOptions::new())
            .unwrap_err(),
        AcquireError::Invalid(overflow)
    );
    futures::executor::block_on(async {
        assert_eq!(
            bulkhead
                .acquire(&req, AcquireOptions::new())
                .await
                .unwrap_err(),
            AcquireError::Invalid(overflow)
        );
        let run = bulkhead
            .run(&req, AcquireOptions::new(), async |_| {
                Ok::<(), std::io::Error>(())
            })
            .await;
        assert!(matches!(run, Err(RunError::Invalid(e)) if e == overflow));
    });
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.admitted,
            stats.rejected,
            stats.in_flight,
            stats.pending
        ),
        (0, 0, 0, 0)
    );
    let tokens = stats.token_budget.unwrap();
    assert_eq!((tokens.in_flight_tokens, tokens.total_reserved), (0, 0));
    // An override still admits: the estimator is not consulted.
    let permit = bulkhead
        .try_acquire(&req, AcquireOptions::new().reservation(res(1, 2)))
        .unwrap();
    assert_eq!(permit.held_tokens(), 3);
}

/// An estimator recording what the bulkhead hands back to `observe`.
struct Recording {
    observed: Mutex<Vec<(TokenEstimate, TokenUsage)>>,
}

impl Estimator for Recording {
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        Ok(TokenEstimate::new(request.text_len(), 20).with_memo(Memo::new(7, request.text_len())))
    }

    fn observe(&self, estimate: &TokenEstimate, usage: TokenUsage) {
        self.observed.lock().unwrap().push((*estimate, usage));
    }
}

#[test]
fn settling_with_usage_hands_the_estimate_and_memo_back() {
    let recording = Arc::new(Recording {
        observed: Mutex::new(Vec::new()),
    });
    let bulkhead = budgeted_with(Arc::clone(&recording));
    let req = LlmRequest::new().user(xs(10));

    bulkhead
        .try_acquire(&req, AcquireOptions::new())
        .unwrap()
        .release(Some(usage(12, 3)));
    let observed = recording.observed.lock().unwrap().clone();
    assert_eq!(
        observed,
        [(
            TokenEstimate::new(10, 20).with_memo(Memo::new(7, 10)),
            usage(12, 3)
        )]
    );
    // No usage, a drop, or an override: nothing is observed.
    bulkhead
        .try_acquire(&req, AcquireOptions::new())
        .unwrap()
        .release(None);
    drop(bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap());
    bulkhead
        .try_acquire(&req, AcquireOptions::new().reservation(res(10, 20)))
        .unwrap()
        .release(Some(usage(1, 1)));
    assert_eq!(recording.observed.lock().unwrap().len(), 1);
    // Owned permits observe like borrowed ones.
    bulkhead
        .try_acquire_owned(&req, AcquireOptions::new())
        .unwrap()
        .release(Some(usage(9, 9)));
    assert_eq!(recording.observed.lock().unwrap().len(), 2);
}

/// An adaptive estimator (smoothing 1, min samples 3) and a bulkhead wired to it in one line.
fn adaptive_bulkhead(max_concurrent: u32, max_queue: u32) -> (Arc<AdaptiveEstimator>, LlmBulkhead) {
    let base = ModelAwareEstimator::builder()
        .default_model("gpt-4o")
        .build()
        .unwrap();
    let adaptive = Arc::new(
        AdaptiveEstimator::builder(base)
            .smoothing(1.0)
            .min_samples(3)
            .build()
            .unwrap(),
    );
    let bulkhead = LlmBulkhead::builder("gpt-4o", max_concurrent)
        .max_queue(max_queue)
        .token_budget(TokenBudget::new(100_000))
        .estimator(adaptive.clone())
        .build()
        .unwrap();
    (adaptive, bulkhead)
}

#[test]
fn adaptive_wired_in_one_line_learns_from_releases_with_usage() {
    let (adaptive, bulkhead) = adaptive_bulkhead(8, 0);
    let req = LlmRequest::new().user(xs(370)).max_tokens(10); // base input 100
    for n in 1..=3u64 {
        let permit = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
        assert_eq!(permit.reservation(), Some(res(100, 10)));
        permit.release(Some(usage(150, 5)));
        let c = adaptive.corrections();
        assert_eq!((c[0].model.as_str(), c[0].samples), ("gpt-4o", n));
    }
    assert_eq!(
        adaptive.corrections(),
        vec![Correction {
            model: "gpt-4o".into(),
            samples: 3,
            factor: 1.5,
            applied: 1.5
        }]
    );
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(150, 10)));
    let corrected = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!(corrected.reservation(), Some(res(150, 10)));
    // A corrected admission is observed against its base (100), not its 150.
    corrected.release(Some(usage(150, 5)));
    let c = adaptive.corrections();
    assert_eq!((c[0].samples, c[0].factor), (4, 1.5));
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(150, 10)));
    // Owned permits feed it too, and other models get their own entry.
    bulkhead
        .try_acquire_owned(&request("claude-sonnet-4", 390), AcquireOptions::new())
        .unwrap()
        .release(Some(usage(80, 1)));
    assert_eq!(models(&adaptive), ["gpt-4o", "claude-sonnet-4"]);
    assert_eq!(adaptive.corrections()[1].factor, 0.8);
}

#[test]
fn releases_without_usage_drops_and_overrides_do_not_feed_adaptive() {
    let (adaptive, bulkhead) = adaptive_bulkhead(8, 0);
    let req = LlmRequest::new().user(xs(370)); // base input 100
    for _ in 0..5 {
        bulkhead
            .try_acquire(&req, AcquireOptions::new())
            .unwrap()
            .release(None);
        drop(bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap());
        drop(
            bulkhead
                .try_acquire_owned(&req, AcquireOptions::new())
                .unwrap(),
        );
        let preview = bulkhead.estimate(&req).unwrap().unwrap();
        bulkhead
            .try_acquire(&req, AcquireOptions::new().reservation(preview))
            .unwrap()
            .release(Some(usage(300, 0)));
    }
    assert!(adaptive.corrections().is_empty());
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(100, 2048)));
    let t = bulkhead.stats().token_budget.unwrap();
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn run_with_usage_feeds_adaptive_and_run_does_not() {
    let (adaptive, bulkhead) = adaptive_bulkhead(8, 0);
    let req = LlmRequest::new().user(xs(370)).max_tokens(50); // base input 100
    futures::executor::block_on(async {
        for _ in 0..3 {
            let reply = bulkhead
                .run_with_usage(
                    &req,
                    AcquireOptions::new(),
                    |input: &u64| TokenUsage::new(*input, 7).ok(),
                    async |ctx| {
                        assert_eq!(ctx.reservation(), Some(res(100, 50)));
                        Ok::<u64, std::io::Error>(120)
                    },
                )
                .await
                .unwrap();
            assert_eq!(reply, 120);
        }
        // Not fed: a plain run, a run whose usage extractor finds none, a failed run, and a
        // run sized by an override.
        bulkhead
            .run(&req, AcquireOptions::new(), async |_| {
                Ok::<u64, std::io::Error>(999)
            })
            .await
            .unwrap();
        bulkhead
            .run_with_usage(
                &req,
                AcquireOptions::new(),
                |_: &u64| None,
                async |_| Ok::<u64, std::io::Error>(999),
            )
            .await
            .unwrap();
        let failed = bulkhead
            .run_with_usage(
                &req,
                AcquireOptions::new(),
                |input: &u64| TokenUsage::new(*input, 0).ok(),
                async |_| Err::<u64, _>(std::io::Error::other("provider down")),
            )
            .await;
        assert!(matches!(failed, Err(RunError::Failed(_))));
        bulkhead
            .run_with_usage(
                &req,
                AcquireOptions::new().reservation(res(100, 50)),
                |input: &u64| TokenUsage::new(*input, 0).ok(),
                async |_| Ok::<u64, std::io::Error>(999),
            )
            .await
            .unwrap();
    });
    assert_eq!(
        adaptive.corrections(),
        vec![Correction {
            model: "gpt-4o".into(),
            samples: 3,
            factor: 1.2,
            applied: 1.2
        }]
    );
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(120, 50)));
}

#[test]
fn usage_is_observed_even_when_the_model_was_evicted_meanwhile() {
    // Upstream §13.5: every release with usage is `observe(request, usage)`, which (re)inserts
    // a model that is not tracked, evicting the oldest-inserted one.
    let base = ModelAwareEstimator::builder().build().unwrap();
    let adaptive = Arc::new(
        AdaptiveEstimator::builder(base)
            .smoothing(1.0)
            .min_samples(1)
            .max_models(2)
            .build()
            .unwrap(),
    );
    let bulkhead = budgeted_with(adaptive.clone());

    // Three new models in flight at once, with room for two.
    let a = bulkhead
        .try_acquire(&request("a", 400), AcquireOptions::new())
        .unwrap();
    let b = bulkhead
        .try_acquire(&request("b", 400), AcquireOptions::new())
        .unwrap();
    let c = bulkhead
        .try_acquire(&request("c", 400), AcquireOptions::new())
        .unwrap();
    a.release(Some(usage(150, 0)));
    assert_eq!(models(&adaptive), ["a"], "the first release is observed");
    b.release(Some(usage(150, 0)));
    c.release(Some(usage(150, 0)));
    assert_eq!(models(&adaptive), ["b", "c"]);

    // A tracked model evicted while one of its calls is in flight comes back on release.
    let in_flight = bulkhead
        .try_acquire(&request("b", 400), AcquireOptions::new())
        .unwrap();
    adaptive
        .observe_request(&request("d", 400), usage(150, 0))
        .unwrap(); // evicts "b"
    assert_eq!(models(&adaptive), ["c", "d"]);
    in_flight.release(Some(usage(120, 0)));
    assert_eq!(models(&adaptive), ["d", "b"]);
    assert_eq!(adaptive.corrections()[1].factor, 1.2);
}

#[test]
fn a_queued_acquire_feeds_adaptive_when_released_with_usage() {
    let (adaptive, bulkhead) = adaptive_bulkhead(1, 1);
    let req = LlmRequest::new().user(xs(370)).max_tokens(10); // base input 100
    futures::executor::block_on(async {
        let first = bulkhead.acquire(&req, AcquireOptions::new()).await.unwrap();
        let mut second = bulkhead.acquire(&req, AcquireOptions::new());
        assert!(futures::poll!(&mut second).is_pending(), "queued");
        assert_eq!(bulkhead.stats().pending, 1);
        drop(first); // hands the slot over; no usage, nothing observed
        let second = second.await.unwrap();
        assert_eq!(second.reservation(), Some(res(100, 10)));
        assert!(adaptive.corrections().is_empty());
        second.release(Some(usage(170, 3)));
    });
    assert_eq!(
        adaptive.corrections(),
        vec![Correction {
            model: "gpt-4o".into(),
            samples: 1,
            factor: 1.7,
            applied: 1.0
        }]
    );
    // The blocking variant too.
    for _ in 0..2 {
        bulkhead
            .acquire_blocking(&req, AcquireOptions::new())
            .unwrap()
            .release(Some(usage(170, 3)));
    }
    assert_eq!(adaptive.corrections()[0].samples, 3);
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(170, 10)));
}

// ===== concurrency =====

#[test]
fn adaptive_shared_by_eight_threads_stays_bounded_and_converges() {
    const MAX_MODELS: usize = 4;
    const THREADS: usize = 8;
    const ROUNDS: usize = 2_000;
    let adaptive = Arc::new(adaptive(0.3, 2, (0.5, 2.0), MAX_MODELS));
    let names: Vec<String> = (0..10).map(|i| format!("Model-{i:02}")).collect();
    let lowercased: HashSet<String> = names.iter().map(|n| n.to_lowercase()).collect();

    let start = std::sync::Barrier::new(THREADS);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let adaptive = Arc::clone(&adaptive);
            let names = &names;
            let start = &start;
            s.spawn(move || {
                start.wait();
                for round in 0..ROUNDS {
                    let name = &names[(t * 3 + round * 7) % names.len()];
                    let name = if round % 2 == 0 {
                        name.to_uppercase()
                    } else {
                        name.clone()
                    };
                    let req = request(&name, 400); // unknown: 4.0, base input 100
                    let estimate = adaptive.estimate(&req).unwrap();
                    assert!(
                        estimate.input == 100 || estimate.input == 125,
                        "{estimate:?}"
                    );
                    assert_eq!(estimate.max_output, 2048);
                    // A constant 1.25x.
                    if round % 3 == 0 {
                        adaptive.observe_request(&req, usage(125, 9)).unwrap();
                    } else {
                        adaptive.observe(&estimate, usage(125, 9));
                    }
                    if round % 16 == 0 {
                        let corrections = adaptive.corrections();
                        assert!(corrections.len() <= MAX_MODELS, "{corrections:?}");
                        for c in corrections {
                            assert_eq!(c.factor, 1.25, "{c:?}");
                        }
                    }
                    if t == 0 && round % 100 == 99 {
                        adaptive.reset(Some(&name));
                    }
                }
            });
        }
    });

    let corrections = adaptive.corrections();
    assert!(!corrections.is_empty());
    assert!(corrections.len() <= MAX_MODELS, "{corrections:?}");
    let distinct: HashSet<&str> = corrections.iter().map(|c| c.model.as_str()).collect();
    assert_eq!(distinct.len(), corrections.len(), "no model tracked twice");
    for c in &corrections {
        assert!(lowercased.contains(&c.model), "{c:?}");
        assert!(c.samples >= 1);
        assert_eq!(c.factor, 1.25, "{c:?}");
        let (applied, input) = if c.samples >= 2 {
            (1.25, 125)
        } else {
            (1.0, 100)
        };
        assert_eq!(c.applied, applied, "{c:?}");
        assert_eq!(
            adaptive.estimate(&request(&c.model, 400)).unwrap().input,
            input
        );
    }
    // Still fully usable afterwards: a new model evicts the oldest survivor.
    let oldest = corrections[0].model.clone();
    adaptive
        .observe_request(&request("fresh-model", 400), usage(150, 0))
        .unwrap();
    let after = models(&adaptive);
    assert!(after.len() <= MAX_MODELS);
    assert_eq!(after.last().map(String::as_str), Some("fresh-model"));
    if corrections.len() == MAX_MODELS {
        assert!(!after.contains(&oldest), "{after:?}");
    }
}
