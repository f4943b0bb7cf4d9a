//! How the bulkhead sizes, previews and learns from admissions with an estimator.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RunError, TokenBudget, TokenUsage,
    admission::Verdict, estimate::AdaptiveEstimator, estimate::Estimator, estimate::Memo,
    estimate::ModelAwareEstimator, estimate::NaiveEstimator, estimate::TokenEstimate,
    request::ContentBlock, request::RequestError,
};

use crate::support::{
    anthropic_body, budgeted, budgeted_with, models, openai_body, parse, request, res, usage, xs,
};

#[test]
fn default_estimator_is_model_aware_seeded_with_model_and_output_cap() {
    let bulkhead = LlmBulkhead::builder("gpt-4o", 4)
        .token_budget(TokenBudget::new(100_000).output_cap(64))
        .build()
        .unwrap();
    let req = LlmRequest::new().user(xs(370));
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(100, 64)));
    assert_eq!(
        bulkhead.estimate(&req.clone().max_tokens(10)).unwrap(),
        Some(res(100, 10))
    );
    let mut newer = req.clone();
    newer.max_completion_tokens = Some(30);
    assert_eq!(bulkhead.estimate(&newer).unwrap(), Some(res(100, 30)));
    // Opaque blocks cost nothing by default; extra input tokens count.
    let multimodal = LlmRequest::new()
        .user(vec![
            ContentBlock::text(xs(370)),
            ContentBlock::opaque("image"),
        ])
        .extra_input_tokens(9);
    assert_eq!(bulkhead.estimate(&multimodal).unwrap(), Some(res(109, 64)));

    // Default output cap 2048; an unknown bulkhead model falls back to 4.0.
    let unknown = budgeted("my-model");
    assert_eq!(
        unknown.estimate(&LlmRequest::new().user(xs(370))).unwrap(),
        Some(res(93, 2048))
    );
    // Without a token budget nothing is estimated.
    let unbudgeted = LlmBulkhead::builder("gpt-4o", 4).build().unwrap();
    assert_eq!(unbudgeted.estimate(&req).unwrap(), None);
    let permit = unbudgeted.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!((permit.reservation(), permit.held_tokens()), (None, 0));
}

#[test]
fn request_model_wins_over_bulkhead_model() {
    let bulkhead = budgeted("gpt-4o");
    // 390 chars: 106 at gpt-4o's 3.7, 100 at claude-sonnet-4's 3.9, 98 at the fallback 4.0.
    assert_eq!(
        bulkhead.estimate(&LlmRequest::new().user(xs(390))).unwrap(),
        Some(res(106, 2048))
    );
    assert_eq!(
        bulkhead.estimate(&request("claude-sonnet-4", 390)).unwrap(),
        Some(res(100, 2048))
    );
    assert_eq!(
        bulkhead.estimate(&request("", 390)).unwrap(),
        Some(res(98, 2048)),
        "an empty request model is used as is"
    );
    let permit = bulkhead
        .try_acquire(&request("claude-sonnet-4", 390), AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.reservation(), Some(res(100, 2048)));
}

#[test]
fn estimate_permit_and_would_admit_agree() {
    let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 8)
        .token_budget(TokenBudget::new(100_000).output_cap(512))
        .build()
        .unwrap();
    let requests = [
        LlmRequest::new().user(xs(390)),
        request("gpt-4o-mini", 1_000).max_tokens(100),
        request("gemini-2.5-flash", 7).extra_input_tokens(40),
        LlmRequest::new().system("日本語").user("\u{1F600}"),
        parse(&openai_body()),
        parse(&anthropic_body()),
    ];
    let expected = [
        res(100, 512),
        res(271, 100),
        res(42, 512),
        res(2, 512),
        res(33, 512),
        res(27, 1024),
    ];
    for (req, want) in requests.iter().zip(expected) {
        let preview = bulkhead.estimate(req).unwrap().unwrap();
        assert_eq!(preview, want);
        let (verdict, detail) = bulkhead
            .would_admit_with_detail(req, AcquireOptions::new())
            .unwrap();
        assert_eq!(verdict, Verdict::Admit);
        assert_eq!(detail.token_budget.unwrap().requested, preview.reserved());
        let permit = bulkhead.try_acquire(req, AcquireOptions::new()).unwrap();
        assert_eq!(permit.reservation(), Some(preview));
        assert_eq!(permit.held_tokens(), preview.reserved());
    }
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn estimate_round_trips_as_the_reservation_override() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&calls);
    let bulkhead = budgeted_with(move |r: &LlmRequest| {
        counter.fetch_add(1, Ordering::SeqCst);
        TokenEstimate::new(r.text_len().div_ceil(3), r.output_ceiling().unwrap_or(700))
    });
    let req = LlmRequest::new().user(xs(301));
    let preview = bulkhead.estimate(&req).unwrap().unwrap();
    assert_eq!(preview, res(101, 700));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "estimate() calls the estimator once"
    );

    let with_preview = AcquireOptions::new().reservation(preview);
    let (_, detail) = bulkhead
        .would_admit_with_detail(&req, with_preview)
        .unwrap();
    assert_eq!(detail.token_budget.unwrap().requested, 801);
    let permit = bulkhead.try_acquire(&req, with_preview).unwrap();
    assert_eq!(permit.reservation(), Some(preview));
    assert_eq!(permit.held_tokens(), 801);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "an override is not estimated"
    );
    drop(permit);

    // Without an override, each admission estimates exactly once.
    let permit = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!(permit.reservation(), Some(preview));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    // The override is taken as is, even when the request says otherwise.
    let other = AcquireOptions::new().reservation(res(5, 6));
    let small = bulkhead.try_acquire(&req, other).unwrap();
    assert_eq!(small.reservation(), Some(res(5, 6)));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[test]
fn custom_closure_estimator_sizes_admissions() {
    let bulkhead = budgeted_with(|r: &LlmRequest| TokenEstimate::new(r.text_len() / 3, 500));
    let req = LlmRequest::new().model("gpt-4o").user(xs(300));
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(100, 500)));
    let permit = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!(permit.reservation(), Some(res(100, 500)));
    // The naive estimator as a bulkhead's estimator.
    let naive = budgeted_with(NaiveEstimator::new().output_cap(100));
    assert_eq!(
        naive.estimate(&request("claude-sonnet-4", 390)).unwrap(),
        Some(res(98, 100))
    );
}

#[test]
fn estimator_output_overflow_is_invalid_and_counts_nothing() {
    let bulkhead = LlmBulkhead::builder("gpt-4o", 2)
        .max_queue(2)
        .token_budget(TokenBudget::new(100_000))
        .estimator(|_: &LlmRequest| TokenEstimate::new(u64::MAX, 1))
        .build()
        .unwrap();
    let req = request("gpt-4o", 10);
    let overflow = RequestError::ReservationOverflow {
        input: u64::MAX,
        max_output: 1,
    };
    assert_eq!(bulkhead.estimate(&req), Err(overflow));
    assert_eq!(
        bulkhead.would_admit(&req, AcquireOptions::new()),
        Err(overflow)
    );
    let err = bulkhead
        .try_acquire(&req, AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err, AcquireError::Invalid(overflow));
    assert_eq!(
        err.to_string(),
        "invalid request: token reservation (18446744073709551615 input + 1 max output) does not fit in 64 bits"
    );
    assert!(err.rejection().is_none());
    assert_eq!(
        bulkhead
            .try_acquire_owned(&req, AcquireOptions::new())
            .unwrap_err(),
        AcquireError::Invalid(overflow)
    );
    futures::executor::block_on(async {
        assert_eq!(
            bulkhead
                .acquire(&req, AcquireOptions::new())
                .await
                .unwrap_err(),
            AcquireError::Invalid(overflow)
        );
        let run = bulkhead
            .run(&req, AcquireOptions::new(), async |_| {
                Ok::<(), std::io::Error>(())
            })
            .await;
        assert!(matches!(run, Err(RunError::Invalid(e)) if e == overflow));
    });
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.admitted,
            stats.rejected,
            stats.in_flight,
            stats.pending
        ),
        (0, 0, 0, 0)
    );
    let tokens = stats.token_budget.unwrap();
    assert_eq!((tokens.in_flight_tokens, tokens.total_reserved), (0, 0));
    // An override still admits: the estimator is not consulted.
    let permit = bulkhead
        .try_acquire(&req, AcquireOptions::new().reservation(res(1, 2)))
        .unwrap();
    assert_eq!(permit.held_tokens(), 3);
}

/// An estimator recording what the bulkhead hands back to `observe`.
struct Recording {
    observed: Mutex<Vec<(TokenEstimate, TokenUsage)>>,
}

impl Estimator for Recording {
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        Ok(TokenEstimate::new(request.text_len(), 20).with_memo(Memo::new(7, request.text_len())))
    }

    fn observe(&self, estimate: &TokenEstimate, usage: TokenUsage) {
        self.observed.lock().unwrap().push((*estimate, usage));
    }
}

#[test]
fn settling_with_usage_hands_the_estimate_and_memo_back() {
    let recording = Arc::new(Recording {
        observed: Mutex::new(Vec::new()),
    });
    let bulkhead = budgeted_with(Arc::clone(&recording));
    let req = LlmRequest::new().user(xs(10));

    bulkhead
        .try_acquire(&req, AcquireOptions::new())
        .unwrap()
        .release(Some(usage(12, 3)));
    let observed = recording.observed.lock().unwrap().clone();
    assert_eq!(
        observed,
        [(
            TokenEstimate::new(10, 20).with_memo(Memo::new(7, 10)),
            usage(12, 3)
        )]
    );
    // No usage, a drop, or an override: nothing is observed.
    bulkhead
        .try_acquire(&req, AcquireOptions::new())
        .unwrap()
        .release(None);
    drop(bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap());
    bulkhead
        .try_acquire(&req, AcquireOptions::new().reservation(res(10, 20)))
        .unwrap()
        .release(Some(usage(1, 1)));
    assert_eq!(recording.observed.lock().unwrap().len(), 1);
    // Owned permits observe like borrowed ones.
    bulkhead
        .try_acquire_owned(&req, AcquireOptions::new())
        .unwrap()
        .release(Some(usage(9, 9)));
    assert_eq!(recording.observed.lock().unwrap().len(), 2);
}

/// An adaptive estimator (smoothing 1, min samples 3) and a bulkhead wired to it in one line.
fn adaptive_bulkhead(
    max_concurrent: usize,
    max_queue: usize,
) -> (Arc<AdaptiveEstimator>, LlmBulkhead) {
    let base = ModelAwareEstimator::builder()
        .default_model("gpt-4o")
        .build()
        .unwrap();
    let adaptive = Arc::new(
        AdaptiveEstimator::builder(base)
            .smoothing(1.0)
            .min_samples(3)
            .build()
            .unwrap(),
    );
    let bulkhead = LlmBulkhead::builder("gpt-4o", max_concurrent)
        .max_queue(max_queue)
        .token_budget(TokenBudget::new(100_000))
        .estimator(adaptive.clone())
        .build()
        .unwrap();
    (adaptive, bulkhead)
}

#[test]
fn adaptive_wired_in_one_line_learns_from_releases_with_usage() {
    let (adaptive, bulkhead) = adaptive_bulkhead(8, 0);
    let req = LlmRequest::new().user(xs(370)).max_tokens(10); // base input 100
    for n in 1..=3u64 {
        let permit = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
        assert_eq!(permit.reservation(), Some(res(100, 10)));
        permit.release(Some(usage(150, 5)));
        let c = adaptive.corrections();
        assert_eq!((c[0].model.as_str(), c[0].samples), ("gpt-4o", n));
    }
    assert_eq!(
        crate::support::tuples(&adaptive),
        vec![crate::support::fields("gpt-4o".to_owned(), 3, 1.5, 1.5)]
    );
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(150, 10)));
    let corrected = bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap();
    assert_eq!(corrected.reservation(), Some(res(150, 10)));
    // A corrected admission is observed against its base (100), not its 150.
    corrected.release(Some(usage(150, 5)));
    let c = adaptive.corrections();
    assert_eq!((c[0].samples, c[0].factor), (4, 1.5));
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(150, 10)));
    // Owned permits feed it too, and other models get their own entry.
    bulkhead
        .try_acquire_owned(&request("claude-sonnet-4", 390), AcquireOptions::new())
        .unwrap()
        .release(Some(usage(80, 1)));
    assert_eq!(models(&adaptive), ["gpt-4o", "claude-sonnet-4"]);
    assert_eq!(adaptive.corrections()[1].factor, 0.8);
}

#[test]
fn releases_without_usage_drops_and_overrides_do_not_feed_adaptive() {
    let (adaptive, bulkhead) = adaptive_bulkhead(8, 0);
    let req = LlmRequest::new().user(xs(370)); // base input 100
    for _ in 0..5 {
        bulkhead
            .try_acquire(&req, AcquireOptions::new())
            .unwrap()
            .release(None);
        drop(bulkhead.try_acquire(&req, AcquireOptions::new()).unwrap());
        drop(
            bulkhead
                .try_acquire_owned(&req, AcquireOptions::new())
                .unwrap(),
        );
        let preview = bulkhead.estimate(&req).unwrap().unwrap();
        bulkhead
            .try_acquire(&req, AcquireOptions::new().reservation(preview))
            .unwrap()
            .release(Some(usage(300, 0)));
    }
    assert!(adaptive.corrections().is_empty());
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(100, 2048)));
    let t = bulkhead.stats().token_budget.unwrap();
    assert_eq!(t.in_flight_tokens, 0);
}

#[test]
fn run_with_usage_feeds_adaptive_and_run_does_not() {
    let (adaptive, bulkhead) = adaptive_bulkhead(8, 0);
    let req = LlmRequest::new().user(xs(370)).max_tokens(50); // base input 100
    futures::executor::block_on(async {
        for _ in 0..3 {
            let reply = bulkhead
                .run_with_usage(
                    &req,
                    AcquireOptions::new(),
                    |input: &u64| TokenUsage::new(*input, 7).ok(),
                    async |ctx| {
                        assert_eq!(ctx.reservation(), Some(res(100, 50)));
                        Ok::<u64, std::io::Error>(120)
                    },
                )
                .await
                .unwrap();
            assert_eq!(reply, 120);
        }
        // Not fed: a plain run, a run whose usage extractor finds none, a failed run, and a
        // run sized by an override.
        bulkhead
            .run(&req, AcquireOptions::new(), async |_| {
                Ok::<u64, std::io::Error>(999)
            })
            .await
            .unwrap();
        bulkhead
            .run_with_usage(
                &req,
                AcquireOptions::new(),
                |_: &u64| None,
                async |_| Ok::<u64, std::io::Error>(999),
            )
            .await
            .unwrap();
        let failed = bulkhead
            .run_with_usage(
                &req,
                AcquireOptions::new(),
                |input: &u64| TokenUsage::new(*input, 0).ok(),
                async |_| Err::<u64, _>(std::io::Error::other("provider down")),
            )
            .await;
        assert!(matches!(failed, Err(RunError::Failed(_))));
        bulkhead
            .run_with_usage(
                &req,
                AcquireOptions::new().reservation(res(100, 50)),
                |input: &u64| TokenUsage::new(*input, 0).ok(),
                async |_| Ok::<u64, std::io::Error>(999),
            )
            .await
            .unwrap();
    });
    assert_eq!(
        crate::support::tuples(&adaptive),
        vec![crate::support::fields("gpt-4o".to_owned(), 3, 1.2, 1.2)]
    );
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(120, 50)));
}

#[test]
fn usage_is_observed_even_when_the_model_was_evicted_meanwhile() {
    // Design §U13.5: every release with usage is `observe(request, usage)`, which (re)inserts
    // a model that is not tracked, evicting the oldest-inserted one.
    let base = ModelAwareEstimator::builder().build().unwrap();
    let adaptive = Arc::new(
        AdaptiveEstimator::builder(base)
            .smoothing(1.0)
            .min_samples(1)
            .max_models(2)
            .build()
            .unwrap(),
    );
    let bulkhead = budgeted_with(adaptive.clone());

    // Three new models in flight at once, with room for two.
    let a = bulkhead
        .try_acquire(&request("a", 400), AcquireOptions::new())
        .unwrap();
    let b = bulkhead
        .try_acquire(&request("b", 400), AcquireOptions::new())
        .unwrap();
    let c = bulkhead
        .try_acquire(&request("c", 400), AcquireOptions::new())
        .unwrap();
    a.release(Some(usage(150, 0)));
    assert_eq!(models(&adaptive), ["a"], "the first release is observed");
    b.release(Some(usage(150, 0)));
    c.release(Some(usage(150, 0)));
    assert_eq!(models(&adaptive), ["b", "c"]);

    // A tracked model evicted while one of its calls is in flight comes back on release.
    let in_flight = bulkhead
        .try_acquire(&request("b", 400), AcquireOptions::new())
        .unwrap();
    adaptive
        .observe_request(&request("d", 400), usage(150, 0))
        .unwrap(); // evicts "b"
    assert_eq!(models(&adaptive), ["c", "d"]);
    in_flight.release(Some(usage(120, 0)));
    assert_eq!(models(&adaptive), ["d", "b"]);
    assert_eq!(adaptive.corrections()[1].factor, 1.2);
}

#[test]
fn a_queued_acquire_feeds_adaptive_when_released_with_usage() {
    let (adaptive, bulkhead) = adaptive_bulkhead(1, 1);
    let req = LlmRequest::new().user(xs(370)).max_tokens(10); // base input 100
    futures::executor::block_on(async {
        let first = bulkhead.acquire(&req, AcquireOptions::new()).await.unwrap();
        let mut second = bulkhead.acquire(&req, AcquireOptions::new());
        assert!(futures::poll!(&mut second).is_pending(), "queued");
        assert_eq!(bulkhead.stats().pending, 1);
        drop(first); // hands the slot over; no usage, nothing observed
        let second = second.await.unwrap();
        assert_eq!(second.reservation(), Some(res(100, 10)));
        assert!(adaptive.corrections().is_empty());
        second.release(Some(usage(170, 3)));
    });
    assert_eq!(
        crate::support::tuples(&adaptive),
        vec![crate::support::fields("gpt-4o".to_owned(), 1, 1.7, 1.0)]
    );
    // The blocking variant too.
    for _ in 0..2 {
        bulkhead
            .acquire_blocking(&req, AcquireOptions::new())
            .unwrap()
            .release(Some(usage(170, 3)));
    }
    assert_eq!(adaptive.corrections()[0].samples, 3);
    assert_eq!(bulkhead.estimate(&req).unwrap(), Some(res(170, 10)));
}
