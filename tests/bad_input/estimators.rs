//! Estimators: ModelAwareEstimator ratios, AdaptiveEstimator options, observe/reset with odd input

use std::sync::Arc;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget,
    estimate::AdaptiveEstimator, estimate::Estimator, estimate::EstimatorError, estimate::Memo,
    estimate::ModelAwareEstimator, estimate::OpaqueBlockTokens, estimate::TokenEstimate,
    request::ContentBlock, request::RequestError,
};

use crate::support::{MODEL, usage};

fn ratio_error(model: &str, ratio: f64) -> EstimatorError {
    ModelAwareEstimator::builder()
        .ratio(model, ratio)
        .build()
        .expect_err("invalid ratio")
}

#[test]
fn model_aware_refuses_ratios_that_are_not_finite_and_positive() {
    // `None`: the value as Rust's `Display` spells it (a long decimal expansion).
    let cases: [(f64, Option<&str>); 9] = [
        (f64::NAN, Some("NaN")),
        (f64::INFINITY, Some("inf")),
        (f64::NEG_INFINITY, Some("-inf")),
        (0.0, Some("0")),
        (-0.0, Some("-0")),
        (-1.0, Some("-1")),
        (-f64::MIN_POSITIVE, None),
        (f64::MIN, None),
        (-5e-324, None),
    ];
    for (ratio, shown) in cases {
        let err = ratio_error("my-model", ratio);
        match &err {
            EstimatorError::InvalidRatio { model, ratio: got } => {
                assert_eq!(model, "my-model");
                assert_eq!(
                    got.to_bits(),
                    ratio.to_bits(),
                    "the refused value, bit for bit"
                );
            }
            other => panic!("{ratio}: {other:?}"),
        }
        let shown = shown.map_or_else(|| ratio.to_string(), str::to_owned);
        assert_eq!(
            err.to_string(),
            format!("ratio override for \"my-model\" must be a finite number > 0 (got {shown})")
        );
    }
    // Empty and whitespace-only model names: the ratio is what is validated.
    assert_eq!(
        ratio_error("", 0.0),
        EstimatorError::InvalidRatio {
            model: String::new(),
            ratio: 0.0
        }
    );
    assert_eq!(
        ratio_error("  ", -2.0).to_string(),
        "ratio override for \"  \" must be a finite number > 0 (got -2)"
    );
}

#[test]
fn model_aware_reports_the_first_invalid_override_even_if_a_later_one_is_valid() {
    let err = ModelAwareEstimator::builder()
        .ratio("a", 1.0)
        .ratio("b", f64::NAN)
        .ratio("c", -1.0)
        .ratio("b", 2.0)
        .build()
        .unwrap_err();
    assert!(
        matches!(&err, EstimatorError::InvalidRatio { model, ratio } if model == "b" && ratio.is_nan())
    );
    assert_eq!(
        err.to_string(),
        "ratio override for \"b\" must be a finite number > 0 (got NaN)"
    );
}

#[test]
fn model_aware_accepts_extreme_positive_ratios_and_refuses_unrepresentable_estimates() {
    for ratio in [f64::MIN_POSITIVE, 5e-324, f64::EPSILON, 1e-3, f64::MAX] {
        let e = ModelAwareEstimator::builder()
            .ratio("m", ratio)
            .build()
            .unwrap_or_else(|err| panic!("{ratio}: {err}"));
        assert_eq!(e.ratio_for("m").to_bits(), ratio.to_bits());
        // No text: nothing to estimate, whatever the ratio.
        assert_eq!(
            e.estimate(&LlmRequest::new().model("m")).unwrap(),
            TokenEstimate::new(0, 2048)
        );
        let one = e.estimate(&LlmRequest::new().model("m").user("x"));
        if ratio < 1e-19 {
            assert_eq!(one, Err(RequestError::TextTooLarge { chars: 1 }), "{ratio}");
        } else {
            assert!(one.is_ok(), "{ratio}");
        }
    }
    // f64::MAX chars per token: any text is one token.
    let e = ModelAwareEstimator::builder()
        .ratio("m", f64::MAX)
        .build()
        .unwrap();
    let long = LlmRequest::new().model("m").user("x".repeat(100_000));
    assert_eq!(e.estimate(&long).unwrap().input, 1);
    // Odd model names never panic and fall back to 4.0.
    let e = ModelAwareEstimator::builder().build().unwrap();
    for model in [
        "",
        " ",
        "\u{212A}",
        &"Ä".repeat(200),
        &"A".repeat(200),
        &"a".repeat(129),
    ] {
        assert_eq!(e.ratio_for(model), 4.0, "{model:?}");
    }
}

fn adaptive_builder() -> async_bulkhead_llm::estimate::AdaptiveEstimatorBuilder {
    AdaptiveEstimator::builder(ModelAwareEstimator::builder().build().unwrap())
}

#[test]
fn adaptive_refuses_invalid_options_in_the_documented_order() {
    use EstimatorError::{MaxCorrection, MaxModels, MinCorrection, MinSamples, Smoothing};
    type Build = fn() -> Result<AdaptiveEstimator, EstimatorError>;
    let nan = f64::NAN;
    let inf = f64::INFINITY;
    let cases: Vec<(&str, Build, EstimatorError, &str)> = vec![
        (
            "smoothing NaN",
            || adaptive_builder().smoothing(f64::NAN).build(),
            Smoothing { value: nan },
            "smoothing must be a finite number in (0, 1] (got NaN)",
        ),
        (
            "smoothing inf",
            || adaptive_builder().smoothing(f64::INFINITY).build(),
            Smoothing { value: inf },
            "smoothing must be a finite number in (0, 1] (got inf)",
        ),
        (
            "smoothing -inf",
            || adaptive_builder().smoothing(f64::NEG_INFINITY).build(),
            Smoothing { value: -inf },
            "smoothing must be a finite number in (0, 1] (got -inf)",
        ),
        (
            "smoothing 0",
            || adaptive_builder().smoothing(0.0).build(),
            Smoothing { value: 0.0 },
            "smoothing must be a finite number in (0, 1] (got 0)",
        ),
        (
            "smoothing -0",
            || adaptive_builder().smoothing(-0.0).build(),
            Smoothing { value: -0.0 },
            "smoothing must be a finite number in (0, 1] (got -0)",
        ),
        (
            "smoothing -0.1",
            || adaptive_builder().smoothing(-0.1).build(),
            Smoothing { value: -0.1 },
            "smoothing must be a finite number in (0, 1] (got -0.1)",
        ),
        (
            "smoothing just above 1",
            || adaptive_builder().smoothing(1.0 + f64::EPSILON).build(),
            Smoothing {
                value: 1.0 + f64::EPSILON,
            },
            "smoothing must be a finite number in (0, 1] (got 1.0000000000000002)",
        ),
        (
            "smoothing first when every option is invalid",
            || {
                adaptive_builder()
                    .smoothing(2.0)
                    .min_samples(0)
                    .min_correction(f64::NAN)
                    .max_correction(-1.0)
                    .max_models(0)
                    .build()
            },
            Smoothing { value: 2.0 },
            "smoothing must be a finite number in (0, 1] (got 2)",
        ),
        (
            "min_samples 0",
            || adaptive_builder().min_samples(0).build(),
            MinSamples { value: 0 },
            "min_samples must be a positive integer (got 0)",
        ),
        (
            "min_samples before the corrections and max_models",
            || {
                adaptive_builder()
                    .min_samples(0)
                    .min_correction(-1.0)
                    .max_correction(f64::NAN)
                    .max_models(0)
                    .build()
            },
            MinSamples { value: 0 },
            "min_samples must be a positive integer (got 0)",
        ),
        (
            "min_correction 0",
            || adaptive_builder().min_correction(0.0).build(),
            MinCorrection { value: 0.0 },
            "min_correction must be a finite number > 0 (got 0)",
        ),
        (
            "min_correction -1",
            || adaptive_builder().min_correction(-1.0).build(),
            MinCorrection { value: -1.0 },
            "min_correction must be a finite number > 0 (got -1)",
        ),
        (
            "min_correction NaN",
            || adaptive_builder().min_correction(f64::NAN).build(),
            MinCorrection { value: nan },
            "min_correction must be a finite number > 0 (got NaN)",
        ),
        (
            "min_correction inf (with max_correction inf)",
            || {
                adaptive_builder()
                    .min_correction(f64::INFINITY)
                    .max_correction(f64::INFINITY)
                    .build()
            },
            MinCorrection { value: inf },
            "min_correction must be a finite number > 0 (got inf)",
        ),
        (
            "min_correction before max_correction and max_models",
            || {
                adaptive_builder()
                    .min_correction(-0.0)
                    .max_correction(f64::NAN)
                    .max_models(0)
                    .build()
            },
            MinCorrection { value: -0.0 },
            "min_correction must be a finite number > 0 (got -0)",
        ),
        (
            "max_correction below min_correction",
            || {
                adaptive_builder()
                    .min_correction(2.0)
                    .max_correction(1.0)
                    .build()
            },
            MaxCorrection {
                value: 1.0,
                min: 2.0,
            },
            "max_correction must be a finite number >= min_correction (2) (got 1)",
        ),
        (
            "max_correction below the default min_correction",
            || adaptive_builder().max_correction(0.25).build(),
            MaxCorrection {
                value: 0.25,
                min: 0.5,
            },
            "max_correction must be a finite number >= min_correction (0.5) (got 0.25)",
        ),
        (
            "max_correction NaN",
            || adaptive_builder().max_correction(f64::NAN).build(),
            MaxCorrection {
                value: nan,
                min: 0.5,
            },
            "max_correction must be a finite number >= min_correction (0.5) (got NaN)",
        ),
        (
            "max_correction inf",
            || adaptive_builder().max_correction(f64::INFINITY).build(),
            MaxCorrection {
                value: inf,
                min: 0.5,
            },
            "max_correction must be a finite number >= min_correction (0.5) (got inf)",
        ),
        (
            "max_correction -inf",
            || adaptive_builder().max_correction(f64::NEG_INFINITY).build(),
            MaxCorrection {
                value: -inf,
                min: 0.5,
            },
            "max_correction must be a finite number >= min_correction (0.5) (got -inf)",
        ),
        (
            "max_correction before max_models",
            || adaptive_builder().max_correction(0.0).max_models(0).build(),
            MaxCorrection {
                value: 0.0,
                min: 0.5,
            },
            "max_correction must be a finite number >= min_correction (0.5) (got 0)",
        ),
        (
            "max_models 0",
            || adaptive_builder().max_models(0).build(),
            MaxModels { value: 0 },
            "max_models must be a positive integer (got 0)",
        ),
    ];
    for (name, build, expected, display) in cases {
        let err = build().expect_err(name);
        // Debug compares NaN and the sign of zero exactly.
        assert_eq!(format!("{err:?}"), format!("{expected:?}"), "{name}");
        assert_eq!(err.to_string(), display, "{name}");
    }
}

#[test]
fn adaptive_accepts_valid_edge_options() {
    let builders = [
        adaptive_builder().smoothing(1.0),
        adaptive_builder().smoothing(f64::MIN_POSITIVE),
        adaptive_builder().min_samples(1),
        adaptive_builder().min_samples(u64::MAX),
        adaptive_builder()
            .min_correction(f64::MIN_POSITIVE)
            .max_correction(f64::MIN_POSITIVE),
        adaptive_builder().min_correction(2.0).max_correction(2.0),
        adaptive_builder().max_correction(f64::MAX),
        adaptive_builder().max_models(1),
        adaptive_builder().max_models(usize::MAX),
    ];
    for builder in builders {
        let a = builder.build().unwrap();
        assert!(a.corrections().is_empty());
        let e = a.estimate(&LlmRequest::new().user("xxxx")).unwrap();
        assert_eq!((e.input, e.max_output), (1, 2048));
    }
}

fn adaptive(min: f64, max: f64) -> AdaptiveEstimator {
    AdaptiveEstimator::builder(ModelAwareEstimator::builder().build().unwrap())
        .smoothing(1.0)
        .min_samples(1)
        .min_correction(min)
        .max_correction(max)
        .build()
        .unwrap()
}

#[test]
fn adaptive_survives_extreme_observations() {
    let a = adaptive(f64::MIN_POSITIVE, f64::MAX);
    let request = LlmRequest::new().model("m").user("xxxx"); // base input 1
    a.observe_request(&request, usage(u64::MAX, 0)).unwrap();
    let c = &a.corrections()[0];
    assert_eq!((c.model.as_str(), c.samples), ("m", 1));
    assert!(c.factor.is_finite() && c.factor > 1e19);
    // A correction that makes the estimate unrepresentable is an error, not a wrap.
    assert_eq!(
        a.estimate(&request),
        Err(RequestError::TextTooLarge { chars: 4 })
    );
    // A zero observation: the factor clamps to the (tiny) minimum, the estimate rounds up.
    a.observe_request(&request, usage(0, 0)).unwrap();
    assert_eq!(a.corrections()[0].factor, 0.0);
    assert_eq!(a.corrections()[0].applied, f64::MIN_POSITIVE);
    assert_eq!(a.estimate(&request).unwrap().input, 1);
}

#[test]
fn adaptive_correction_of_a_huge_extra_input_is_refused_as_text_too_large() {
    // Documented: TextTooLarge also covers "an adaptive correction of a huge estimate". Its
    // `chars` is the request's text length, here 0 (the input came from extra tokens).
    let a = adaptive(0.5, 2.0);
    let model = LlmRequest::new().model("m");
    a.observe_request(&model.clone().user("x".repeat(400)), usage(200, 0))
        .unwrap(); // factor 2
    let huge = model.clone().extra_input_tokens(1 << 63);
    assert_eq!(
        a.estimate(&huge),
        Err(RequestError::TextTooLarge { chars: 0 })
    );
    assert_eq!(
        RequestError::TextTooLarge { chars: 0 }.to_string(),
        "estimated input for 0 characters does not fit in 64 bits"
    );
    // Through a bulkhead: Invalid, nothing counted.
    let b = LlmBulkhead::builder(MODEL, 2)
        .token_budget(TokenBudget::new(1000))
        .estimator(Arc::new(a))
        .build()
        .unwrap();
    let before = b.stats();
    assert_eq!(
        b.try_acquire(&huge, AcquireOptions::new()).unwrap_err(),
        AcquireError::Invalid(RequestError::TextTooLarge { chars: 0 })
    );
    assert_eq!(b.stats(), before);
}

#[test]
fn adaptive_observe_request_with_an_unrepresentable_request_changes_nothing() {
    let a = adaptive(0.5, 2.0);
    a.observe_request(&LlmRequest::new().model("m").user("xxxx"), usage(2, 0))
        .unwrap();
    let before = a.corrections();
    let bad = LlmRequest::new()
        .model("m")
        .user("x".repeat(8))
        .extra_input_tokens(u64::MAX);
    assert_eq!(
        a.observe_request(&bad, usage(5, 5)),
        Err(RequestError::InputOverflow {
            text_tokens: 2,
            opaque_tokens: 0,
            extra_input_tokens: u64::MAX
        })
    );
    let bad_new_model = bad.clone().model("never-seen");
    assert!(a.observe_request(&bad_new_model, usage(5, 5)).is_err());
    assert_eq!(a.corrections(), before);
}

#[test]
fn adaptive_observe_with_forged_memos_never_panics_and_changes_nothing() {
    let a = adaptive(0.5, 2.0);
    let seen = a
        .estimate(&LlmRequest::new().model("m").user("xxxx"))
        .unwrap();
    a.observe(&seen, usage(2, 0));
    let before = a.corrections();
    let forged = [
        Memo::new(u64::MAX, u64::MAX),
        Memo::new(u64::MAX, 0),
        Memo::new(1 << 32, 1),                     // slot 1 does not exist
        Memo::new((1000 << 32) | 1, 100),          // nor slot 1000
        Memo::new(0xFFFF_FFFF, 100),               // slot 0, generation u32::MAX
        Memo::new(seen.memo().parts().0 + 1, 100), // slot 0, a wrong generation
        Memo::new(0, u64::MAX),                    // "empty"
    ];
    for memo in forged {
        for u in [usage(0, 0), usage(u64::MAX, 0), usage(1, u64::MAX - 1)] {
            a.observe(&TokenEstimate::new(u64::MAX, u64::MAX).with_memo(memo), u);
        }
    }
    assert_eq!(a.corrections(), before);
}

#[test]
fn adaptive_reset_with_unknown_or_empty_models_changes_nothing() {
    let a = adaptive(0.5, 2.0);
    a.reset(None); // empty table
    a.reset(Some(""));
    assert!(a.corrections().is_empty());
    a.observe_request(&LlmRequest::new().model("m").user("xxxx"), usage(2, 0))
        .unwrap();
    let before = a.corrections();
    for model in ["", " ", "never-seen", "\u{212A}", &"Z".repeat(300)] {
        a.reset(Some(model));
    }
    assert_eq!(a.corrections(), before);
    a.reset(Some("M")); // matched lowercased
    assert!(a.corrections().is_empty());
}

#[test]
fn opaque_block_tokens_by_type_overflow_is_an_input_overflow() {
    let e = ModelAwareEstimator::builder()
        .opaque_block_tokens(OpaqueBlockTokens::by_type(
            Some(u64::MAX - 1),
            [("image", 1)],
        ))
        .build()
        .unwrap();
    // 1 + (u64::MAX - 1) fits; one more block does not.
    let fits = LlmRequest::new().user(vec![
        ContentBlock::opaque("image"),
        ContentBlock::opaque("doc"),
    ]);
    assert_eq!(e.estimate(&fits).unwrap().input, u64::MAX);
    let over = LlmRequest::new().user(vec![
        ContentBlock::opaque("image"),
        ContentBlock::opaque("doc"),
        ContentBlock::opaque("image"),
    ]);
    assert_eq!(
        e.estimate(&over),
        Err(RequestError::InputOverflow {
            text_tokens: 0,
            opaque_tokens: u64::MAX,
            extra_input_tokens: 0
        })
    );
}
