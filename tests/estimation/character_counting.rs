//! Character counting in UTF-16 code units.

use async_bulkhead_llm::{LlmRequest, request::Content, request::ContentBlock};
use proptest::prelude::*;

use crate::support::{kinds, utf16, xs};

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
