//! The canonical form of a request, which the default deduplication key digests: two requests
//! have the same form exactly when their JSON bodies are equal up to the order of object keys
//! and null object members (so an absent optional field equals a null one); arrays keep their
//! order.
//!
//! The form is fed straight to the hasher, walking the request's typed fields and its `extra`
//! JSON values where they are: nothing is serialized or copied first (a 2,000-character prompt
//! is fed as one slice). It is not JSON but a prefix-free encoding of the same tree, so no
//! string needs scanning for escapes: every value starts with a tag, strings and containers
//! carry their length, numbers their binary value. The typed walk must produce the same bytes
//! as walking the request's own JSON (`serde_json::to_value`); a test checks it on requests
//! with every kind of field.
//!
//! Without the `serde` feature a request has only its typed fields, fed the same way.

use super::request::{Content, ContentBlock, LlmRequest, Message};

/// Where the form goes: the hasher, or a byte vector in tests.
pub(crate) trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for sha2::Sha256 {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        sha2::Digest::update(self, bytes);
    }
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

const NULL: u8 = b'z';
#[cfg(feature = "serde")]
const TRUE: u8 = b't';
#[cfg(feature = "serde")]
const FALSE: u8 = b'f';
const UNSIGNED: u8 = b'u';
#[cfg(feature = "serde")]
const SIGNED: u8 = b'i';
#[cfg(feature = "serde")]
const FLOAT: u8 = b'd';
const STRING: u8 = b's';
const ARRAY: u8 = b'a';
const OBJECT: u8 = b'o';

/// Feeds the canonical form of `request`.
pub(crate) fn feed(request: &LlmRequest, sink: &mut impl Sink) {
    let mut stack = Vec::with_capacity(16);
    Node::Request(request).feed(sink, &mut stack);
}

/// A value of the request's JSON tree, where it lives.
#[derive(Clone, Copy)]
enum Node<'a> {
    Request(&'a LlmRequest),
    Message(&'a Message),
    Messages(&'a [Message]),
    Content(&'a Content),
    Block(&'a ContentBlock),
    Str(&'a str),
    Unsigned(u64),
    /// A JSON null (dropped as an object member, kept in an array).
    Null,
    #[cfg(feature = "serde")]
    Json(&'a serde_json::Value),
}

/// An object's members waiting to be sorted: `(key, value)`.
type Members<'a> = Vec<(&'a str, Node<'a>)>;

impl<'a> Node<'a> {
    fn feed(self, sink: &mut impl Sink, stack: &mut Members<'a>) {
        match self {
            Node::Request(request) => {
                let start = stack.len();
                if let Some(model) = &request.model {
                    stack.push(("model", Node::Str(model)));
                }
                stack.push(("messages", Node::Messages(&request.messages)));
                if let Some(system) = &request.system {
                    stack.push(("system", Node::Content(system)));
                }
                for (key, value) in [
                    ("max_tokens", request.max_tokens),
                    ("max_completion_tokens", request.max_completion_tokens),
                    ("extra_input_tokens", request.extra_input_tokens),
                ] {
                    if let Some(value) = value {
                        stack.push((key, Node::Unsigned(value)));
                    }
                }
                #[cfg(feature = "serde")]
                push_json(stack, &request.extra);
                object(sink, stack, start);
            }
            Node::Message(message) => {
                let start = stack.len();
                stack.push(("role", Node::Str(&message.role)));
                stack.push((
                    "content",
                    message.content.as_ref().map_or(Node::Null, Node::Content),
                ));
                #[cfg(feature = "serde")]
                push_json(stack, &message.extra);
                object(sink, stack, start);
            }
            Node::Messages(messages) => {
                array_header(sink, messages.len());
                for message in messages {
                    Node::Message(message).feed(sink, stack);
                }
            }
            Node::Content(Content::Text(text)) => Node::Str(text).feed(sink, stack),
            Node::Content(Content::Blocks(blocks)) => {
                array_header(sink, blocks.len());
                for block in blocks {
                    Node::Block(block).feed(sink, stack);
                }
            }
            #[cfg(feature = "serde")]
            Node::Block(ContentBlock::Text { text, extra }) => {
                let start = stack.len();
                stack.push(("type", Node::Str("text")));
                stack.push(("text", Node::Str(text)));
                push_json(stack, extra);
                object(sink, stack, start);
            }
            #[cfg(not(feature = "serde"))]
            Node::Block(ContentBlock::Text { text, .. }) => {
                let start = stack.len();
                stack.push(("type", Node::Str("text")));
                stack.push(("text", Node::Str(text)));
                object(sink, stack, start);
            }
            #[cfg(feature = "serde")]
            Node::Block(ContentBlock::Opaque { data, .. }) => Node::Json(data).feed(sink, stack),
            #[cfg(not(feature = "serde"))]
            Node::Block(ContentBlock::Opaque { kind, .. }) => {
                let start = stack.len();
                stack.push(("type", Node::Str(kind)));
                object(sink, stack, start);
            }
            Node::Str(text) => {
                sink.put(&[STRING]);
                sink.put(&(text.len() as u64).to_le_bytes());
                sink.put(text.as_bytes());
            }
            Node::Unsigned(n) => {
                sink.put(&[UNSIGNED]);
                sink.put(&n.to_le_bytes());
            }
            Node::Null => sink.put(&[NULL]),
            #[cfg(feature = "serde")]
            Node::Json(value) => json(value, sink, stack),
        }
    }
}

/// Pushes the members of a JSON map (an `extra`).
#[cfg(feature = "serde")]
fn push_json<'a>(stack: &mut Members<'a>, map: &'a serde_json::Map<String, serde_json::Value>) {
    stack.extend(map.iter().map(|(k, v)| (k.as_str(), Node::Json(v))));
}

#[cfg(feature = "serde")]
fn json<'a>(value: &'a serde_json::Value, sink: &mut impl Sink, stack: &mut Members<'a>) {
    use serde_json::Value;
    match value {
        Value::Null => sink.put(&[NULL]),
        Value::Bool(true) => sink.put(&[TRUE]),
        Value::Bool(false) => sink.put(&[FALSE]),
        Value::Number(n) => {
            if let Some(n) = n.as_u64() {
                Node::Unsigned(n).feed(sink, stack);
            } else if let Some(n) = n.as_i64() {
                sink.put(&[SIGNED]);
                sink.put(&n.to_le_bytes());
            } else {
                sink.put(&[FLOAT]);
                sink.put(&n.as_f64().unwrap_or(f64::NAN).to_bits().to_le_bytes());
            }
        }
        Value::String(text) => Node::Str(text).feed(sink, stack),
        Value::Array(items) => {
            array_header(sink, items.len());
            for item in items {
                json(item, sink, stack);
            }
        }
        Value::Object(map) => {
            let start = stack.len();
            push_json(stack, map);
            object(sink, stack, start);
        }
    }
}

fn array_header(sink: &mut impl Sink, len: usize) {
    sink.put(&[ARRAY]);
    sink.put(&(len as u64).to_le_bytes());
}

/// Feeds the object whose members were pushed from `start` on: null members dropped, keys
/// sorted bytewise, a repeated key keeping its last value (as a JSON map built from the same
/// members would); then pops them.
fn object<'a>(sink: &mut impl Sink, stack: &mut Members<'a>, start: usize) {
    // Stable: equal keys keep their order, so the last of a run is the last pushed.
    stack[start..].sort_by(|a, b| a.0.cmp(b.0));
    let end = stack.len();
    let kept = |i: usize, stack: &Members<'a>| {
        !stack[i].1.is_null() && (i + 1 == end || stack[i + 1].0 != stack[i].0)
    };
    let count = (start..end).filter(|&i| kept(i, stack)).count();
    sink.put(&[OBJECT]);
    sink.put(&(count as u64).to_le_bytes());
    for i in start..end {
        if kept(i, stack) {
            let (key, value) = stack[i];
            Node::Str(key).feed(sink, stack);
            value.feed(sink, stack);
        }
    }
    stack.truncate(start);
}

impl Node<'_> {
    fn is_null(&self) -> bool {
        match self {
            Node::Null => true,
            #[cfg(feature = "serde")]
            Node::Json(value) => value.is_null(),
            _ => false,
        }
    }
}

#[cfg(all(test, not(loom), feature = "serde"))]
mod tests {
    use serde_json::json;

    use super::{Members, feed, json};
    use crate::llm::request::LlmRequest;

    /// The form of a JSON value, walked as JSON.
    fn of_json(value: &serde_json::Value) -> Vec<u8> {
        let mut out = Vec::new();
        let mut stack: Members<'_> = Vec::new();
        json(value, &mut out, &mut stack);
        out
    }

    fn of_request(request: &LlmRequest) -> Vec<u8> {
        let mut out = Vec::new();
        feed(request, &mut out);
        out
    }

    #[test]
    fn the_typed_walk_feeds_what_the_requests_json_feeds() {
        let bodies = [
            json!({}),
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}),
            json!({
                "model": "claude-sonnet-4-5",
                "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
                "messages": [
                    {"role": "user", "content": [
                        {"type": "text", "text": "Describe"},
                        {"type": "image", "source": {"type": "base64", "data": "AAAA"}},
                        {"type": "text", "text": 42},
                        "a bare string block",
                        null
                    ]},
                    {"role": "assistant", "content": null, "tool_calls": [{"id": "1", "args": {"b": 1, "a": [1.5, -2, null]}}]},
                    {"role": "tool", "tool_call_id": "1"}
                ],
                "max_completion_tokens": 64,
                "extra_input_tokens": 3,
                "temperature": 0.2,
                "stream": true,
                "stop": ["x", "y"],
                "metadata": {"z": null, "y": {"k": false}},
                "top_p": null
            }),
        ];
        for body in bodies {
            let request: LlmRequest = serde_json::from_value(body).unwrap();
            let written = serde_json::to_value(&request).unwrap();
            assert_eq!(of_request(&request), of_json(&written), "{written}");
        }
    }

    #[test]
    fn a_key_in_extra_that_repeats_a_typed_field_wins_as_in_json() {
        let mut request = LlmRequest::new().model("a");
        request.extra.insert("model".into(), json!("b"));
        let written = serde_json::to_value(&request).unwrap();
        assert_eq!(written["model"], "b");
        assert_eq!(of_request(&request), of_json(&written));
    }

    #[test]
    fn order_and_nulls_do_not_matter_and_everything_else_does() {
        let form = |v: serde_json::Value| of_json(&v);
        assert_eq!(form(json!({"a": 1, "b": 2})), form(json!({"b": 2, "a": 1})));
        assert_eq!(form(json!({"a": 1, "n": null})), form(json!({"a": 1})));
        assert_ne!(form(json!([1, 2])), form(json!([2, 1])));
        assert_ne!(form(json!([null])), form(json!([])));
        assert_ne!(form(json!(1)), form(json!(1.0)));
        assert_ne!(form(json!("1")), form(json!(1)));
        assert_ne!(form(json!({"ab": "c"})), form(json!({"a": "bc"})));
        assert_ne!(form(json!(["a", "b"])), form(json!(["ab"])));
    }
}
