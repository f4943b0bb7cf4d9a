//! Arbitrary bytes as a JSON request body (OpenAI chat-completions, Anthropic messages, or
//! anything else `serde_json` will read).
//!
//! For every body that parses as an `LlmRequest`:
//!
//! - the JSON round trip is stable: serialize, parse again, get the same request and the same
//!   bytes when serialized once more;
//! - `NaiveEstimator`, `ModelAwareEstimator` (default, and with overrides and an opaque-block
//!   surcharge) and an `AdaptiveEstimator` never panic, are deterministic for the same request,
//!   agree with each other where their documents say they must, and refuse only with a
//!   `RequestError` whose figures really do not fit;
//! - on budgeted bulkheads, `estimate`, `would_admit` and `try_acquire` agree with the estimator
//!   and with each other, refuse with the typed error, and leave nothing held.
//!
//! Bodies that do not parse must fail with a `serde_json` error (never a panic).

#![no_main]

use std::sync::Arc;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Priority, RejectReason, Reservation,
    TokenBudget, TokenUsage, admission::Verdict, estimate::AdaptiveEstimator, estimate::Estimator,
    estimate::ModelAwareEstimator, estimate::NaiveEstimator, estimate::OpaqueBlockTokens,
    estimate::TokenEstimate, request::RequestError,
};
use libfuzzer_sys::fuzz_target;

/// Characters per token of the built-in families (all at most the 4.0 fallback).
const FALLBACK_RATIO: f64 = 4.0;

fuzz_target!(|data: &[u8]| {
    let request = match serde_json::from_slice::<LlmRequest>(data) {
        Ok(request) => request,
        Err(err) => {
            // The error must render (the token-count messages format the refused value).
            let _ = err.to_string();
            return;
        }
    };
    round_trip(&request);
    estimators(&request);
    bulkheads(&request);
});

/// Serialize, parse again, serialize again: same request, same bytes.
fn round_trip(request: &LlmRequest) {
    let json = serde_json::to_vec(request).expect("an LlmRequest always serializes");
    let again: LlmRequest = serde_json::from_slice(&json).unwrap_or_else(|err| {
        panic!(
            "the serialized form does not parse back: {err}\n{}",
            String::from_utf8_lossy(&json)
        )
    });
    assert_eq!(&again, request, "round trip changed the request");
    let json_again = serde_json::to_vec(&again).expect("serializes");
    assert_eq!(json, json_again, "serialization is not stable");
    // The value form agrees with the byte form.
    let value = serde_json::to_value(request).expect("serializes to a value");
    let from_value: LlmRequest = serde_json::from_value(value).expect("value parses back");
    assert_eq!(&from_value, request, "value round trip changed the request");
    // Everything the estimators read survives too.
    assert_eq!(again.text_len(), request.text_len());
    assert_eq!(again.output_ceiling(), request.output_ceiling());
    assert_eq!(opaque_kinds(&again), opaque_kinds(request));
}

fn opaque_kinds(request: &LlmRequest) -> Vec<String> {
    let mut kinds = Vec::new();
    request.for_each_opaque_block(|kind| kinds.push(kind.to_owned()));
    kinds
}

/// Estimates twice (must agree), checks a refusal is one of the typed errors and is justified.
fn estimate_twice(
    name: &str,
    estimator: &dyn Estimator,
    request: &LlmRequest,
) -> Result<TokenEstimate, RequestError> {
    let first = estimator.estimate(request);
    let second = estimator.estimate(request);
    assert_eq!(
        first, second,
        "{name}: estimates differ for the same request"
    );
    match &first {
        Ok(estimate) => {
            // `reservation()` either fits or says exactly why not.
            match estimate.reservation() {
                Ok(r) => {
                    assert_eq!(r.input(), estimate.input);
                    assert_eq!(r.max_output(), estimate.max_output);
                    assert_eq!(
                        u128::from(r.reserved()),
                        u128::from(estimate.input) + u128::from(estimate.max_output)
                    );
                }
                Err(err) => check_reservation_overflow(name, &err, estimate),
            }
        }
        Err(err) => check_request_error(name, err, request),
    }
    first
}

fn check_reservation_overflow(name: &str, err: &RequestError, estimate: &TokenEstimate) {
    assert_eq!(
        *err,
        RequestError::ReservationOverflow {
            input: estimate.input,
            max_output: estimate.max_output
        },
        "{name}: wrong reservation error"
    );
    assert!(
        u128::from(estimate.input) + u128::from(estimate.max_output) > u128::from(u64::MAX),
        "{name}: {err} but the sum fits"
    );
    let _ = err.to_string();
}

/// An estimator's refusal: `InputOverflow` whose parts really overflow, or `TextTooLarge`
/// naming the request's text length.
fn check_request_error(name: &str, err: &RequestError, request: &LlmRequest) {
    let _ = err.to_string();
    match *err {
        RequestError::InputOverflow {
            text_tokens,
            opaque_tokens,
            extra_input_tokens,
        } => {
            assert_eq!(
                extra_input_tokens,
                request.extra_input_tokens.unwrap_or(0),
                "{name}: {err}"
            );
            let sum = u128::from(text_tokens)
                + u128::from(opaque_tokens)
                + u128::from(extra_input_tokens);
            assert!(
                sum > u128::from(u64::MAX) || opaque_tokens == u64::MAX,
                "{name}: {err} but the parts fit"
            );
        }
        RequestError::TextTooLarge { chars } => {
            assert_eq!(chars, request.text_len(), "{name}: {err}");
        }
        other => panic!("{name}: unexpected estimator error {other:?}"),
    }
}

fn estimators(request: &LlmRequest) {
    let chars = request.text_len();
    let extra = request.extra_input_tokens.unwrap_or(0);
    let ceiling = request.output_ceiling();

    // Naive: exactly ceil(chars / 4) + extra, output ceiling or the cap.
    let naive = estimate_twice("naive", &NaiveEstimator::new(), request);
    let expected_input = u128::from(chars.div_ceil(4)) + u128::from(extra);
    match naive {
        Ok(e) => {
            assert_eq!(u128::from(e.input), expected_input, "naive input");
            assert_eq!(e.max_output, ceiling.unwrap_or(2048), "naive output");
        }
        Err(err) => {
            assert!(
                expected_input > u128::from(u64::MAX),
                "naive refused: {err}"
            );
        }
    }
    let capped = NaiveEstimator::new().output_cap(u64::MAX);
    if let Ok(e) = estimate_twice("naive capped", &capped, request) {
        assert_eq!(e.max_output, ceiling.unwrap_or(u64::MAX));
    }

    // Model-aware, defaults: the unknown-model ratio is the naive one, and every family ratio
    // is below it, so it never estimates less than naive.
    let plain = ModelAwareEstimator::builder()
        .build()
        .expect("no overrides");
    let model_aware = estimate_twice("model-aware", &plain, request);
    let ratio = plain.ratio_for(request.model.as_deref().unwrap_or(""));
    assert!(ratio > 0.0 && ratio <= FALLBACK_RATIO, "ratio {ratio}");
    match (&naive, &model_aware) {
        (Ok(n), Ok(m)) => {
            assert_eq!(m.max_output, n.max_output);
            if ratio == FALLBACK_RATIO {
                assert_eq!(m.input, n.input, "unknown model must estimate as naive");
            } else {
                assert!(m.input >= n.input, "family ratio below 4 estimated less");
            }
        }
        (Err(_), Ok(m)) => panic!("naive refused what model-aware estimated as {m:?}"),
        _ => {}
    }

    // Model-aware with overrides (including the request's own model, lowercased, at an extreme
    // ratio), a default model and an opaque-block surcharge.
    let model = request.model.clone().unwrap_or_default();
    let overridden = ModelAwareEstimator::builder()
        .ratio("gpt-4o", 1.0)
        .ratio("claude-sonnet-4", 1e-9)
        .ratio(model.to_lowercase(), 0.25)
        .default_model("claude-3-haiku")
        .output_cap(u64::MAX / 2)
        .opaque_block_tokens(OpaqueBlockTokens::by_type(
            Some(1_500),
            [("image", u64::MAX / 3), ("document", 4_000), ("", 7)],
        ))
        .build()
        .expect("valid overrides");
    let first = estimate_twice("model-aware overrides", &overridden, request);
    if let (Ok(plain), Ok(over)) = (&model_aware, &first) {
        // Ratio 0.25 for the request's own model (or the table's, if an earlier override
        // matched exactly) is at most any table ratio, and the surcharge only adds.
        if request.model.is_some() {
            assert!(over.input >= plain.input, "overrides estimated less");
        }
    }
    let each = ModelAwareEstimator::builder()
        .opaque_block_tokens(OpaqueBlockTokens::Each(u64::MAX / 2 + 1))
        .build()
        .expect("valid");
    let with_each = estimate_twice("model-aware each", &each, request);
    let blocks = opaque_kinds(request).len() as u128;
    if let Ok(plain) = &model_aware {
        let sum = u128::from(plain.input) + blocks * u128::from(u64::MAX / 2 + 1);
        match &with_each {
            Ok(e) => assert_eq!(u128::from(e.input), sum, "surcharge of {blocks} blocks"),
            Err(err) => assert!(sum > u128::from(u64::MAX), "refused {err} though it fits"),
        }
    }

    // Adaptive: learns from one observation, stays deterministic, never corrects the output.
    let adaptive = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build().unwrap())
        .smoothing(1.0)
        .min_samples(1)
        .min_correction(0.5)
        .max_correction(2.0)
        .max_models(2)
        .build()
        .expect("valid adaptive options");
    let before = estimate_twice("adaptive", &adaptive, request);
    match (&before, &model_aware) {
        (Ok(a), Ok(m)) => {
            assert_eq!((a.input, a.max_output), (m.input, m.max_output));
        }
        (Err(a), Err(m)) => assert_eq!(a, m),
        (a, m) => panic!("adaptive {a:?} vs model-aware {m:?} before any observation"),
    }
    if let Ok(base) = before {
        // The provider counted (say) a tenth of the characters, plus one.
        let actual = chars / 10 + 1;
        adaptive.observe(&base, TokenUsage::new(actual, 0).unwrap());
        let after = estimate_twice("adaptive after", &adaptive, request);
        match after {
            Ok(after) => {
                assert_eq!(after.max_output, base.max_output, "output corrected");
                if base.input == 0 {
                    assert_eq!(after.input, 0);
                } else if base.input < 1 << 50 {
                    let factor = (actual as f64 / base.input as f64).clamp(0.5, 2.0);
                    let want = base.input as f64 * factor;
                    let got = after.input as f64;
                    assert!(
                        got >= want.floor() - 1.0 && got <= want.ceil() + 1.0,
                        "adaptive corrected {} to {} (factor {factor})",
                        base.input,
                        after.input
                    );
                }
            }
            Err(err) => check_request_error("adaptive after", &err, request),
        }
        adaptive
            .observe_request(request, TokenUsage::new(actual, 1).unwrap())
            .expect("base estimate fits, so observe_request does");
        let _ = estimate_twice("adaptive observed twice", &adaptive, request);
        for c in adaptive.corrections() {
            assert!(c.applied >= 0.5 && c.applied <= 2.0, "{c:?}");
        }
        adaptive.reset(request.model.as_deref());
        let reset = estimate_twice("adaptive reset", &adaptive, request);
        if request.model.is_some() || adaptive.corrections().is_empty() {
            assert_eq!(
                reset.map(|e| e.input),
                Ok(base.input),
                "reset kept a correction"
            );
        }
        adaptive.reset(None);
        assert!(adaptive.corrections().is_empty());
    }
}

/// What the bulkhead must answer for `request`, given the estimator's `estimate`.
fn bulkheads(request: &LlmRequest) {
    // The default estimator: model-aware seeded with the bulkhead's model and output cap.
    for (model, budget, reserve, cap) in [
        ("claude-sonnet-4", 200_000, 40_000, 4_096),
        ("gpt-4o", 1_000, 1_000, 0),
        ("my-model", 0, 0, 2_048),
        ("o3", async_bulkhead_llm::limits::MAX_BUDGET, 1, u64::MAX),
    ] {
        let bulkhead = LlmBulkhead::builder(model, 3)
            .token_budget(
                TokenBudget::new(budget)
                    .high_priority_reserve(reserve)
                    .output_cap(cap),
            )
            .build()
            .expect("valid configuration");
        let reference = ModelAwareEstimator::builder()
            .default_model(model)
            .output_cap(cap)
            .build()
            .unwrap();
        let expected = reference.estimate(request).and_then(|e| e.reservation());
        check_bulkhead(&bulkhead, request, expected, budget, reserve);
    }

    // An adaptive estimator wired in: releases with usage feed it through the memo.
    let adaptive = Arc::new(
        AdaptiveEstimator::builder(
            ModelAwareEstimator::builder()
                .default_model("gpt-4o")
                .build()
                .unwrap(),
        )
        .min_samples(1)
        .smoothing(0.5)
        .build()
        .unwrap(),
    );
    let bulkhead = LlmBulkhead::builder("gpt-4o", 2)
        .token_budget(TokenBudget::new(1 << 30))
        .estimator(adaptive.clone())
        .build()
        .unwrap();
    let first = bulkhead.estimate(request);
    assert_eq!(
        first,
        bulkhead.estimate(request),
        "estimate not deterministic"
    );
    if let Ok(Some(reservation)) = first {
        match bulkhead.try_acquire(request, AcquireOptions::new().priority(Priority::High)) {
            Ok(permit) => {
                assert_eq!(permit.reservation(), Some(reservation));
                let usage = TokenUsage::new(reservation.input() / 3 + 1, 1).unwrap();
                let report = permit.release(Some(usage));
                assert_eq!(report.held_tokens, reservation.reserved());
            }
            Err(AcquireError::Rejected(r)) => {
                assert_eq!(r.reason(), RejectReason::BudgetLimit);
                assert!(reservation.reserved() > 1 << 30);
            }
            Err(err) => panic!("estimated {reservation:?} but acquire said {err}"),
        }
        let after = bulkhead.estimate(request);
        assert_eq!(after, bulkhead.estimate(request));
        assert_eq!(bulkhead.stats().in_flight, 0);
        assert_eq!(bulkhead.stats().token_budget.unwrap().in_flight_tokens, 0);
    }

    // Without a budget nothing is estimated and everything fits.
    let unbudgeted = LlmBulkhead::builder("gpt-4o", 1).build().unwrap();
    assert_eq!(unbudgeted.estimate(request), Ok(None));
    assert_eq!(
        unbudgeted.would_admit(request, AcquireOptions::new()),
        Ok(Verdict::Admit)
    );
    let permit = unbudgeted
        .try_acquire(request, AcquireOptions::new())
        .expect("no budget: admitted");
    assert_eq!((permit.held_tokens(), permit.reservation()), (0, None));
}

fn check_bulkhead(
    bulkhead: &LlmBulkhead,
    request: &LlmRequest,
    expected: Result<Reservation, RequestError>,
    budget: u64,
    reserve: u64,
) {
    let estimate = bulkhead.estimate(request);
    assert_eq!(estimate, expected.map(Some), "bulkhead estimate");
    assert_eq!(estimate, bulkhead.estimate(request), "not deterministic");
    for priority in [Priority::Normal, Priority::High] {
        let options = AcquireOptions::new().priority(priority);
        let verdict = bulkhead.would_admit(request, options);
        let stats_before = bulkhead.stats();
        let acquired = bulkhead.try_acquire(request, options);
        match expected {
            Err(err) => {
                assert_eq!(verdict, Err(err));
                assert_eq!(acquired.err(), Some(AcquireError::Invalid(err)));
                let stats = bulkhead.stats();
                assert_eq!(
                    (stats.admitted, stats.rejected),
                    (stats_before.admitted, stats_before.rejected),
                    "an invalid request was counted"
                );
            }
            Ok(reservation) => {
                let effective = match priority {
                    Priority::High => budget,
                    Priority::Normal => budget.saturating_sub(reserve),
                };
                let fits = reservation.reserved() <= effective;
                let want = if fits {
                    Verdict::Admit
                } else {
                    Verdict::Reject(RejectReason::BudgetLimit)
                };
                assert_eq!(verdict, Ok(want), "{reservation:?} {priority:?}");
                match acquired {
                    Ok(permit) => {
                        assert!(fits, "admitted {reservation:?} over {effective}");
                        assert_eq!(permit.reservation(), Some(reservation));
                        assert_eq!(permit.held_tokens(), reservation.reserved());
                        let t = bulkhead.stats().token_budget.unwrap();
                        assert_eq!(t.in_flight_tokens, reservation.reserved());
                        // Passing the estimate back admits the same reservation.
                        let again = bulkhead
                            .would_admit(&LlmRequest::new(), options.reservation(reservation));
                        assert!(again.is_ok());
                        drop(permit);
                    }
                    Err(AcquireError::Rejected(rejection)) => {
                        assert!(!fits, "refused {reservation:?} under {effective}");
                        assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                        let detail = rejection.detail().token_budget.unwrap();
                        assert_eq!(detail.requested, reservation.reserved());
                        assert_eq!(detail.effective_budget, effective);
                        let _ = rejection.to_string();
                    }
                    Err(err) => panic!("{reservation:?}: {err}"),
                }
            }
        }
        let stats = bulkhead.stats();
        assert_eq!(stats.in_flight, 0);
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 0);
    }
}
