//! Estimation of a 2,000-character prompt: ASCII (the fast path) and mixed non-ASCII text,
//! with each built-in estimator, beside the obvious `encode_utf16().count()` baseline for the
//! counting alone. Figures are recorded in `benches/README.md`.

use std::hint::black_box;
use std::time::Duration;

use async_bulkhead_llm::{
    LlmRequest, TokenUsage, estimate::AdaptiveEstimator, estimate::Estimator,
    estimate::ModelAwareEstimator, estimate::NaiveEstimator,
};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// About 2,000 characters of English prose.
fn ascii_prompt() -> String {
    let sentence = "The bulkhead admits a call only when a slot and its tokens are free. ";
    sentence.repeat(2000 / sentence.len() + 1)[..2000].to_owned()
}

/// About 2,000 characters mixing Latin, accented, CJK and emoji text.
fn mixed_prompt() -> String {
    let sentence = "Café déjà vu — 日本語のテキスト, emoji 🚀 and plain words. ";
    let mut out = String::new();
    while out.chars().count() < 2000 {
        out.push_str(sentence);
    }
    out.chars().take(2000).collect()
}

fn estimate(c: &mut Criterion) {
    let naive = NaiveEstimator::new();
    let model_aware = ModelAwareEstimator::builder()
        .default_model("claude-sonnet-4")
        .build()
        .expect("valid");
    let adaptive = AdaptiveEstimator::builder(
        ModelAwareEstimator::builder()
            .default_model("claude-sonnet-4")
            .build()
            .expect("valid"),
    )
    .min_samples(1)
    .build()
    .expect("valid");
    let warm = LlmRequest::new().user(ascii_prompt());
    adaptive
        .observe_request(&warm, TokenUsage::new(600, 0).expect("small"))
        .expect("fits");

    for (name, prompt) in [
        ("ascii_2000", ascii_prompt()),
        ("mixed_2000", mixed_prompt()),
    ] {
        let mut group = c.benchmark_group(format!("estimate/{name}"));
        group.throughput(Throughput::Elements(1));
        let request = LlmRequest::new()
            .system("You are a helpful assistant.")
            .user(prompt.clone());
        let with_model = request.clone().model("gpt-4o-mini-2024-07-18");
        group.bench_function("utf16_count_baseline", |b| {
            b.iter(|| black_box(black_box(prompt.as_str()).encode_utf16().count()))
        });
        group.bench_function("text_len", |b| {
            b.iter(|| black_box(black_box(&request).text_len()))
        });
        group.bench_function("naive", |b| {
            b.iter(|| black_box(naive.estimate(black_box(&request))))
        });
        group.bench_function(BenchmarkId::new("model_aware", "default_model"), |b| {
            b.iter(|| black_box(model_aware.estimate(black_box(&request))))
        });
        group.bench_function(BenchmarkId::new("model_aware", "request_model"), |b| {
            b.iter(|| black_box(model_aware.estimate(black_box(&with_model))))
        });
        group.bench_function("adaptive", |b| {
            b.iter(|| black_box(adaptive.estimate(black_box(&request))))
        });
        group.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2))
        .sample_size(40);
    targets = estimate
}
criterion_main!(benches);
