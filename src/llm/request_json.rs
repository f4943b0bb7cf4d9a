//! JSON (serde) form of [`LlmRequest`]: reads OpenAI chat-completions and Anthropic messages
//! bodies, keeps every field it does not interpret, and writes the same shape back.
//!
//! - A message's `content` is a string, an array of blocks, or `null`/absent (`None`, written
//!   back as `null`).
//! - A block is a text block when `type == "text"` and `text` is a string; any other block is
//!   opaque and kept whole.
//! - `max_tokens`, `max_completion_tokens` and `extra_input_tokens` (alias `extraInputTokens`)
//!   must be non-negative integers (a whole number written as a float, `2.0` or `1e3`, counts,
//!   as in JavaScript); anything else is refused with a message naming the field and the
//!   value, as the JavaScript original words it.

use serde::de::{self, Deserializer};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::request::{Content, ContentBlock, LlmRequest, Message};

/// Reads an optional token count, refusing anything but a non-negative integer (or `null`).
fn token_count<'de, D: Deserializer<'de>>(
    field: &'static str,
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    match Option::<Value>::deserialize(deserializer)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) if n.as_u64().is_some() => Ok(n.as_u64()),
        // JSON has one number type: a whole float is the integer it spells (below 2^64).
        Some(Value::Number(n)) if n.as_f64().is_some_and(is_whole_u64) => {
            Ok(n.as_f64().map(|f| f as u64))
        }
        Some(other) => Err(de::Error::custom(format_args!(
            "request.{field} must be an integer >= 0 (got {other})"
        ))),
    }
}

fn is_whole_u64(f: f64) -> bool {
    f.fract() == 0.0 && (0.0..18_446_744_073_709_551_616.0).contains(&f)
}

fn max_tokens<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    token_count("max_tokens", d)
}

fn max_completion_tokens<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    token_count("max_completion_tokens", d)
}

fn extra_input_tokens<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    token_count("extra_input_tokens", d)
}

#[derive(Deserialize)]
struct RequestRepr {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default, deserialize_with = "max_tokens")]
    max_tokens: Option<u64>,
    #[serde(default, deserialize_with = "max_completion_tokens")]
    max_completion_tokens: Option<u64>,
    #[serde(
        default,
        alias = "extraInputTokens",
        deserialize_with = "extra_input_tokens"
    )]
    extra_input_tokens: Option<u64>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

impl<'de> Deserialize<'de> for LlmRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<LlmRequest, D::Error> {
        let r = RequestRepr::deserialize(deserializer)?;
        Ok(LlmRequest {
            model: r.model,
            messages: r.messages,
            system: r.system,
            max_tokens: r.max_tokens,
            max_completion_tokens: r.max_completion_tokens,
            extra_input_tokens: r.extra_input_tokens,
            extra: r.extra,
        })
    }
}

impl Serialize for LlmRequest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        if let Some(model) = &self.model {
            map.serialize_entry("model", model)?;
        }
        map.serialize_entry("messages", &self.messages)?;
        if let Some(system) = &self.system {
            map.serialize_entry("system", system)?;
        }
        if let Some(n) = self.max_tokens {
            map.serialize_entry("max_tokens", &n)?;
        }
        if let Some(n) = self.max_completion_tokens {
            map.serialize_entry("max_completion_tokens", &n)?;
        }
        if let Some(n) = self.extra_input_tokens {
            map.serialize_entry("extra_input_tokens", &n)?;
        }
        for (key, value) in &self.extra {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

#[derive(Deserialize)]
struct MessageRepr {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

impl<'de> Deserialize<'de> for Message {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Message, D::Error> {
        let m = MessageRepr::deserialize(deserializer)?;
        Ok(Message {
            role: m.role,
            content: m.content,
            extra: m.extra,
        })
    }
}

impl Serialize for Message {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        map.serialize_entry("role", &self.role)?;
        map.serialize_entry("content", &self.content)?;
        for (key, value) in &self.extra {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Content, D::Error> {
        match Value::deserialize(deserializer)? {
            Value::String(text) => Ok(Content::Text(text)),
            Value::Array(items) => Ok(Content::Blocks(items.into_iter().map(block).collect())),
            other => Err(de::Error::custom(format_args!(
                "content must be a string or an array of blocks (got {other})"
            ))),
        }
    }
}

/// Classifies one block: a well-formed text block, or an opaque block kept whole.
fn block(value: Value) -> ContentBlock {
    let Value::Object(mut data) = value else {
        // Not even an object: opaque, of no type, kept as it was.
        return ContentBlock::Opaque {
            kind: String::new(),
            data: value,
        };
    };
    let kind = match data.get("type") {
        Some(Value::String(kind)) => kind.clone(),
        _ => String::new(),
    };
    if kind == "text" && matches!(data.get("text"), Some(Value::String(_))) {
        data.remove("type");
        let Some(Value::String(text)) = data.remove("text") else {
            unreachable!()
        };
        return ContentBlock::Text { text, extra: data };
    }
    ContentBlock::Opaque {
        kind,
        data: Value::Object(data),
    }
}

impl Serialize for Content {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Content::Text(text) => serializer.serialize_str(text),
            Content::Blocks(blocks) => blocks.serialize(serializer),
        }
    }
}

impl Serialize for ContentBlock {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ContentBlock::Text { text, extra } => {
                let mut map = serializer.serialize_map(None)?;
                map.serialize_entry("type", "text")?;
                map.serialize_entry("text", text)?;
                for (key, value) in extra {
                    map.serialize_entry(key, value)?;
                }
                map.end()
            }
            ContentBlock::Opaque { data, .. } => data.serialize(serializer),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn reads_an_anthropic_body_and_writes_it_back() {
        let body = json!({
            "model": "claude-sonnet-4-5",
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "Describe"},
                    {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                    {"type": "text", "text": 42}
                ]},
                {"role": "assistant", "content": "Sure."}
            ],
            "max_tokens": 1024,
            "stream": true
        });
        let request: LlmRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(request.text_len(), 9 + 8 + 5);
        let mut kinds = Vec::new();
        request.for_each_opaque_block(|k| kinds.push(k.to_owned()));
        assert_eq!(
            kinds,
            ["image", "text"],
            "a text block without string text is opaque"
        );
        assert_eq!(request.extra["stream"], true);
        assert_eq!(serde_json::to_value(&request).unwrap(), body);
    }

    #[test]
    fn reads_openai_tool_turns_and_null_content() {
        let body = json!({
            "model": "gpt-4o",
            "messages": [
                {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]},
                {"role": "tool", "tool_call_id": "1", "content": "42"}
            ],
            "max_completion_tokens": 64
        });
        let request: LlmRequest = serde_json::from_value(body).unwrap();
        assert_eq!(request.text_len(), 2);
        assert_eq!(request.messages[0].content, None);
        assert_eq!(request.output_ceiling(), Some(64));
        assert_eq!(request.messages[1].extra["tool_call_id"], "1");
    }

    #[test]
    fn refuses_invalid_token_counts_naming_field_and_value() {
        for (body, message) in [
            (
                json!({"max_tokens": -1}),
                "request.max_tokens must be an integer >= 0 (got -1)",
            ),
            (
                json!({"max_tokens": 1.5}),
                "request.max_tokens must be an integer >= 0 (got 1.5)",
            ),
            (
                json!({"extraInputTokens": "7"}),
                "request.extra_input_tokens must be an integer >= 0 (got \"7\")",
            ),
            (
                json!({"max_completion_tokens": true}),
                "request.max_completion_tokens must be an integer >= 0 (got true)",
            ),
        ] {
            let err = serde_json::from_value::<LlmRequest>(body)
                .unwrap_err()
                .to_string();
            assert!(err.contains(message), "{err}");
        }
        let ok: LlmRequest =
            serde_json::from_value(json!({"max_tokens": null, "extra_input_tokens": 3})).unwrap();
        assert_eq!((ok.max_tokens, ok.extra_input_tokens), (None, Some(3)));
    }

    #[test]
    fn refuses_content_that_is_neither_text_nor_blocks() {
        let err = serde_json::from_value::<LlmRequest>(
            json!({"messages": [{"role": "user", "content": 5}]}),
        );
        assert!(
            err.unwrap_err()
                .to_string()
                .contains("content must be a string or an array of blocks")
        );
    }
}
