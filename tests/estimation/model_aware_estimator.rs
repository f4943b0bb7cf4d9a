//! The model-aware estimator: the ratio table, overrides, opaque blocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use async_bulkhead_llm::{
    LlmRequest, estimate::Estimator, estimate::EstimatorError, estimate::ModelAwareEstimator,
    estimate::OpaqueBlockTokens, estimate::TokenEstimate, request::ContentBlock,
    request::RequestError, usage::DEFAULT_OUTPUT_CAP,
};
use serde_json::json;

use crate::support::{input_of, parse, plain, recording_hook, request, seen, xs};

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
