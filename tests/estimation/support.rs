//! Helpers shared by the estimation tests.

use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    LlmBulkhead, LlmRequest, Reservation, TokenBudget, TokenUsage, estimate::AdaptiveEstimator,
    estimate::Estimator, estimate::ModelAwareEstimator,
};
use serde_json::{Value, json};

pub(crate) fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage::new(input, output).expect("usage fits in u64")
}

pub(crate) fn res(input: u64, max_output: u64) -> Reservation {
    Reservation::new(input, max_output).expect("reservation fits in u64")
}

pub(crate) fn xs(n: usize) -> String {
    "x".repeat(n)
}

/// A request for `model` with one user message of `chars` ASCII characters.
pub(crate) fn request(model: &str, chars: usize) -> LlmRequest {
    LlmRequest::new().model(model).user(xs(chars))
}

/// UTF-16 code units of `text`, the reference count.
pub(crate) fn utf16(text: &str) -> u64 {
    text.encode_utf16().count() as u64
}

/// The model-aware estimator with no options.
pub(crate) fn plain() -> ModelAwareEstimator {
    ModelAwareEstimator::builder()
        .build()
        .expect("no overrides to refuse")
}

/// An adaptive estimator over [`plain`] with the given options.
pub(crate) fn adaptive(
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

pub(crate) fn input_of(estimator: &impl Estimator, request: &LlmRequest) -> u64 {
    estimator.estimate(request).expect("estimate fits").input
}

/// The kinds of the request's opaque blocks, in visiting order.
pub(crate) fn kinds(request: &LlmRequest) -> Vec<String> {
    let mut kinds = Vec::new();
    request.for_each_opaque_block(|kind| kinds.push(kind.to_owned()));
    kinds
}

/// Observed models of an adaptive estimator, oldest first.
pub(crate) fn models(adaptive: &AdaptiveEstimator) -> Vec<String> {
    adaptive
        .corrections()
        .into_iter()
        .map(|c| c.model)
        .collect()
}

pub(crate) fn parse(body: &Value) -> LlmRequest {
    serde_json::from_value(body.clone()).expect("a valid request body")
}

pub(crate) fn parse_err(body: Value) -> String {
    serde_json::from_value::<LlmRequest>(body)
        .expect_err("the body must be refused")
        .to_string()
}

/// A hook recording every model it is told about, and the record.
pub(crate) fn recording_hook() -> (
    Arc<Mutex<Vec<String>>>,
    impl Fn(&str) + Send + Sync + 'static,
) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    (seen, move |model: &str| {
        log.lock().unwrap().push(model.to_owned())
    })
}

pub(crate) fn seen(log: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    log.lock().unwrap().clone()
}

/// A bulkhead for `model` with a 100,000-token budget and the default estimator.
pub(crate) fn budgeted(model: &str) -> LlmBulkhead {
    LlmBulkhead::builder(model, 8)
        .token_budget(TokenBudget::new(100_000))
        .build()
        .expect("valid configuration")
}

/// A bulkhead with a 100,000-token budget sized by `estimator`.
pub(crate) fn budgeted_with(estimator: impl Estimator + 'static) -> LlmBulkhead {
    LlmBulkhead::builder("gpt-4o", 8)
        .token_budget(TokenBudget::new(100_000))
        .estimator(estimator)
        .build()
        .expect("valid configuration")
}

/// A removed `"content"` of message `index`, so the rest of a body can be compared.
pub(crate) fn without_content(mut body: Value, index: usize) -> Value {
    body["messages"][index]
        .as_object_mut()
        .expect("a message object")
        .remove("content");
    body
}

/// A realistic OpenAI chat-completions body. Its text is 49 + 25 + 27 + 19 = 120 UTF-16 units
/// (119 chars, 126 bytes): the image caption ends with U+1F5BC U+FE0F (3 units).
pub(crate) fn openai_body() -> Value {
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
pub(crate) fn anthropic_body() -> Value {
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

/// A correction's fields, `(model, samples, factor, applied)`, to compare (a `Correction` is
/// `#[non_exhaustive]`).
pub(crate) type Fields = (String, u64, f64, f64);

pub(crate) fn fields(model: String, samples: u64, factor: f64, applied: f64) -> Fields {
    (model, samples, factor, applied)
}

/// Every correction of `a`, oldest first, as [`Fields`].
pub(crate) fn tuples(a: &async_bulkhead_llm::estimate::AdaptiveEstimator) -> Vec<Fields> {
    a.corrections()
        .into_iter()
        .map(|c| (c.model, c.samples, c.factor, c.applied))
        .collect()
}
