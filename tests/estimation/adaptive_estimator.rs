//! The adaptive estimator.

use async_bulkhead_llm::{
    LlmRequest, estimate::AdaptiveEstimator, estimate::AdaptiveEstimatorBuilder,
    estimate::Estimator, estimate::EstimatorError, estimate::ModelAwareEstimator,
    estimate::OpaqueBlockTokens, estimate::TokenEstimate, request::ContentBlock,
    request::RequestError,
};

use crate::support::{
    adaptive, fields, input_of, models, plain, recording_hook, request, seen, tuples, usage, xs,
};

/// An adaptive estimator that adopts each observation at once (smoothing 1, one sample).
fn learning_at_once(base: ModelAwareEstimator) -> AdaptiveEstimator {
    AdaptiveEstimator::builder(base)
        .smoothing(1.0)
        .min_samples(1)
        .build()
        .unwrap()
}

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
    assert_eq!(tuples(&a), vec![fields("gpt-4o".to_owned(), 3, 1.5, 1.5)]);
}

#[test]
fn adaptive_upstream_clamp_examples() {
    let a = adaptive(1.0, 1, (0.8, 1.5), 64);
    let req = request("gpt-4o", 370); // base input 100
    a.observe_request(&req, usage(1000, 0)).unwrap();
    assert_eq!(a.estimate(&req).unwrap().input, 150);
    assert_eq!(tuples(&a), vec![fields("gpt-4o".to_owned(), 1, 10.0, 1.5)]);
    a.reset(None);
    a.observe_request(&req, usage(1, 0)).unwrap();
    assert_eq!(a.estimate(&req).unwrap().input, 80);
    assert_eq!(tuples(&a), vec![fields("gpt-4o".to_owned(), 1, 0.01, 0.8)]);
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
            tuples(&a),
            vec![fields(
                "claude-sonnet-4".to_owned(),
                samples,
                factor,
                applied
            )],
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
    let a = learning_at_once(base);
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
    let a = learning_at_once(base);
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
    let a = learning_at_once(base);
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
    assert_eq!(tuples(&a), vec![fields(String::new(), 1, 1.8, 1.8)]);
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
        tuples(&a),
        vec![
            fields("b".to_owned(), 1, 1.2, 1.2),
            fields("c".to_owned(), 1, 1.4, 1.4),
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
    let a = learning_at_once(base);
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
