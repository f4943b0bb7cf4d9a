//! The naive estimator.

use async_bulkhead_llm::{
    LlmRequest, estimate::Estimator, estimate::NaiveEstimator, estimate::TokenEstimate,
    request::ContentBlock, request::RequestError, usage::DEFAULT_OUTPUT_CAP,
};

use crate::support::{input_of, request, xs};

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
