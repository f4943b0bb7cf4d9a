//! The provider's usage in a response as it passes: which reader a response gets (server-sent
//! events, a JSON document, or nothing readable), the event lines of a stream (only lines that
//! mention `usage` are parsed, and an unfinished line is kept up to a bound), and the usage
//! blocks of the OpenAI and Anthropic formats.

use http::header::CONTENT_TYPE;

use crate::vocabulary::reservation::TokenUsage;

/// A non-streamed JSON response is read for its usage up to this size; a larger one settles
/// with the usage reported so far.
pub(super) const MAX_JSON_RESPONSE: usize = 4 << 20;

/// How a response's usage is read.
pub(super) enum Reader {
    /// `text/event-stream`: every complete event line that mentions `usage`.
    Events(EventLines),
    /// `application/json`: the whole body, read at its end.
    Json(Vec<u8>),
    /// Anything else: no usage (the call settles with nothing reported).
    Other,
}

impl Reader {
    /// The reader of a response with these headers: by its content type; none for an encoded
    /// (compressed) body, whose bytes say nothing readable.
    pub(super) fn for_response(headers: &http::HeaderMap) -> Reader {
        let encoded = headers
            .get(http::header::CONTENT_ENCODING)
            .is_some_and(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        if encoded {
            return Reader::Other;
        }
        let kind = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or("").trim());
        match kind {
            Some(k) if k.eq_ignore_ascii_case("text/event-stream") => {
                Reader::Events(EventLines::default())
            }
            Some(k) if k.eq_ignore_ascii_case("application/json") => Reader::Json(Vec::new()),
            _ => Reader::Other,
        }
    }
}

/// The longest unfinished line kept between chunks; the rest of a longer line (a large
/// content delta, a stream that never sends a newline) is skipped up to its end.
const MAX_PARTIAL_LINE: usize = 64 << 10;

/// Splits a server-sent event stream into lines as chunks pass, keeping only the unfinished
/// tail of a chunk (a line cut in two by the network, at most [`MAX_PARTIAL_LINE`]); lines
/// are looked at in place. Lines end with LF or CRLF (a bare CR, which the SSE format also
/// allows, is not a line end here), and an event's `data:` is read from one line.
#[derive(Default)]
pub(super) struct EventLines {
    partial: Vec<u8>,
    /// The current line outgrew `MAX_PARTIAL_LINE`: skipped up to its end.
    skipping: bool,
}

impl EventLines {
    /// Feeds `chunk`, calling `found` with the JSON of each complete `data:` line that
    /// states a usage.
    pub(super) fn feed(&mut self, chunk: &[u8], mut found: impl FnMut(&serde_json::Value)) {
        let mut rest = chunk;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            let (line, after) = rest.split_at(end);
            rest = &after[1..];
            if core::mem::take(&mut self.skipping) {
                continue;
            }
            if self.partial.is_empty() {
                Self::line(line, &mut found);
            } else {
                self.partial.extend_from_slice(line);
                Self::line(&self.partial, &mut found);
                self.partial.clear();
            }
        }
        if rest.is_empty() || self.skipping {
            return;
        }
        if self.partial.len() + rest.len() > MAX_PARTIAL_LINE {
            self.partial.clear();
            self.skipping = true;
        } else {
            self.partial.extend_from_slice(rest);
        }
    }

    fn line(line: &[u8], found: &mut impl FnMut(&serde_json::Value)) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(data) = line.strip_prefix(b"data:") else {
            return;
        };
        // Only events that state a usage are parsed: with `include_usage` every OpenAI chunk
        // says `"usage":null`.
        if !states_usage(data) {
            return;
        }
        if let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) {
            found(&json);
        }
    }
}

/// Whether some `"usage":` in `data` is followed by something other than `null`.
fn states_usage(data: &[u8]) -> bool {
    const KEY: &[u8] = b"\"usage\":";
    let mut rest = data;
    while let Some(at) = rest.windows(KEY.len()).position(|w| w == KEY) {
        rest = &rest[at + KEY.len()..];
        if !rest.trim_ascii_start().starts_with(b"null") {
            return true;
        }
    }
    false
}

/// The cumulative usage a provider's JSON document states: OpenAI's `usage` (`prompt_tokens`,
/// `completion_tokens`; in a streamed chunk with `stream_options.include_usage`, or a whole
/// response), Anthropic's `message_start` (`message.usage`) and `message_delta` (`usage`,
/// whose `output_tokens` is cumulative), or a messages response's `usage` (`input_tokens`,
/// `output_tokens`; cache reads and writes count as input).
pub fn provider_usage(json: &serde_json::Value) -> Option<TokenUsage> {
    usage_of(json.get("usage"), json.get("message"))
}

/// The top-level members of a JSON response that [`provider_usage`](crate::tower::provider_usage) reads; every other
/// member is skipped without being built (a whole response as a `serde_json::Value` is a tree
/// of maps: about a fifth of the layer's time per request, measured with `perf`).
#[derive(serde::Deserialize)]
struct UsageDocument {
    usage: Option<serde_json::Value>,
    message: Option<serde_json::Value>,
}

/// [`provider_usage`](crate::tower::provider_usage) of a whole JSON response body, reading only its `usage` and `message`
/// members. A body that is not a JSON object, or that names either member twice, states no
/// usage.
pub(super) fn json_response_usage(body: &[u8]) -> Option<TokenUsage> {
    let document: UsageDocument = serde_json::from_slice(body).ok()?;
    usage_of(document.usage.as_ref(), document.message.as_ref())
}

/// The usage a document states from its top-level `usage` and `message` members: `usage` if
/// it is an object, else `message.usage` (see [`provider_usage`](crate::tower::provider_usage)).
fn usage_of(
    usage: Option<&serde_json::Value>,
    message: Option<&serde_json::Value>,
) -> Option<TokenUsage> {
    let usage = usage
        .filter(|u| u.is_object())
        .or_else(|| message.and_then(|m| m.get("usage")))?;
    usage_block(usage)
}

/// The usage a provider's `usage` block states (see [`provider_usage`](crate::tower::provider_usage)).
fn usage_block(usage: &serde_json::Value) -> Option<TokenUsage> {
    let n = |key: &str| usage.get(key).and_then(serde_json::Value::as_u64);
    if let (Some(input), Some(output)) = (n("prompt_tokens"), n("completion_tokens")) {
        return TokenUsage::new(input, output).ok();
    }
    let input = n("input_tokens").map(|i| {
        i.saturating_add(n("cache_creation_input_tokens").unwrap_or(0))
            .saturating_add(n("cache_read_input_tokens").unwrap_or(0))
    });
    match (input, n("output_tokens")) {
        (Some(input), Some(output)) => TokenUsage::new(input, output).ok(),
        // A `message_delta` states the output only: the input stands as reported before
        // (cumulative reports keep each field's maximum).
        (None, Some(output)) => TokenUsage::new(0, output).ok(),
        (Some(input), None) => TokenUsage::new(input, 0).ok(),
        (None, None) => None,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{EventLines, MAX_PARTIAL_LINE, json_response_usage, provider_usage, states_usage};

    /// The typed read of a JSON response agrees with `provider_usage` of the whole document.
    #[test]
    fn a_json_response_is_read_for_its_usage_like_the_whole_document() {
        let documents: [&str; 12] = [
            r#"{"id":"x","choices":[{"message":{"content":"ok"}}],"usage":{"prompt_tokens":500,"completion_tokens":20}}"#,
            r#"{"type":"message","content":[{"type":"text","text":"hi"}],"usage":{"input_tokens":7,"cache_read_input_tokens":3,"output_tokens":9}}"#,
            r#"{"type":"message_start","message":{"id":"m","usage":{"input_tokens":12,"output_tokens":1}}}"#,
            r#"{"usage":null,"message":{"usage":{"input_tokens":4,"output_tokens":2}}}"#,
            r#"{"usage":"none","message":"text"}"#,
            r#"{"usage":{"output_tokens":5}}"#,
            r#"{"usage":{"prompt_tokens":-1,"completion_tokens":2}}"#,
            r#"{"choices":[]}"#,
            r#"[{"usage":{"prompt_tokens":1,"completion_tokens":1}}]"#,
            r#"not json"#,
            r#"{"usage":{"prompt_tokens":1,"completion_tokens":1}"#,
            r#"{"message":{"content":"x"},"usage":{"input_tokens":1,"output_tokens":0}}"#,
        ];
        let mut stated = 0;
        for document in documents {
            let whole = serde_json::from_str::<serde_json::Value>(document)
                .ok()
                .and_then(|json| provider_usage(&json));
            assert_eq!(
                json_response_usage(document.as_bytes()),
                whole,
                "{document}"
            );
            stated += usize::from(whole.is_some());
        }
        assert_eq!(stated, 6);
    }

    fn lines(chunks: &[&[u8]]) -> (Vec<serde_json::Value>, usize) {
        let mut events = EventLines::default();
        let mut found = Vec::new();
        let mut kept = 0;
        for chunk in chunks {
            events.feed(chunk, |json| found.push(json.clone()));
            kept = kept.max(events.partial.len());
        }
        (found, kept)
    }

    #[test]
    fn a_line_split_anywhere_is_read_once_whole() {
        let event = b"data: {\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4}}\r\n\r\n";
        for cut in 0..event.len() {
            let (found, _) = lines(&[&event[..cut], &event[cut..]]);
            assert_eq!(found.len(), 1, "cut at {cut}");
            assert_eq!(found[0]["usage"]["prompt_tokens"], 3);
        }
    }

    #[test]
    fn null_usage_is_not_parsed_and_a_line_without_end_is_bounded() {
        assert!(!states_usage(b" {\"choices\":[],\"usage\":null}"));
        assert!(!states_usage(b" {\"usage\": null, \"x\": 1}"));
        assert!(states_usage(
            b" {\"usage\":null,\"message\":{\"usage\":{\"input_tokens\":1}}}"
        ));
        let (found, _) = lines(&[b"data: {\"usage\":null}\n"]);
        assert!(found.is_empty());
        // A stream that never sends a newline keeps at most MAX_PARTIAL_LINE bytes, then
        // skips to the next line end and reads the line after it.
        let filler = vec![b'x'; 16 << 10];
        let mut chunks: Vec<&[u8]> = vec![b"data: {\"usage\":"];
        chunks.extend(std::iter::repeat_n(&filler[..], 8));
        chunks.push(b"}\ndata: {\"usage\":{\"output_tokens\":5}}\n");
        let (found, kept) = lines(&chunks);
        assert!(kept <= MAX_PARTIAL_LINE, "kept {kept}");
        assert_eq!(found.len(), 1);
        assert_eq!(found[0]["usage"]["output_tokens"], 5);
    }
}
