//! Deduplication and observe mode, side by side with their baselines in one run.
//!
//! A call's round trip is timed without an executor: its future is made, polled once with a
//! no-op waker (an admitted call whose callback is ready at once finishes in that poll, which
//! the bench asserts) and dropped.
//!
//! - `dedup_unique_key/*`: the round trip of a 2,000-character request (one user message of
//!   the estimate bench's ASCII prose) with a token budget and the reservation given, so
//!   nothing is estimated: `run` on a bulkhead without deduplication, `run_shared` on one with
//!   `Deduplication::new()` where every call's key is new (it leads: canonical JSON, SHA-256,
//!   registration, the flight, its removal), and `run_shared` there with `no_dedup()`. Every
//!   case sets the request's `max_tokens` to a fresh counter first, so the keys differ and the
//!   variation costs the same everywhere.
//! - `dedup_follower_join/{10_keys,10000_keys}`: a bulkhead with deduplication and N leaders
//!   in flight (admitted, their callbacks pending forever, alive until the case ends); one
//!   iteration makes a follower `run_shared` of one of those keys (round-robin) and drops it
//!   unpolled: a join and a leave, which should not depend on N. The request is short (a
//!   one-line message, the key in `max_tokens`) so that hashing it does not hide the registry.
//! - `observe_admitted/*`: the round trip of `run` for an admitted call with
//!   `observe(ShadowReasons::ALL)` (the advisory check before the admission) against the same
//!   `run` without observe mode.
//!
//! `benches/targets.py` checks the targets; `benches/README.md` says what each group measures.

use std::convert::Infallible;
use std::future::Future;
use std::hint::black_box;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, Reservation, RunContext, RunError, TokenBudget,
    dedup::Deduplication, observe::ShadowReasons,
};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// Enough slots for 10,000 leaders in flight.
const SLOTS: u32 = 16_384;
const BUDGET: u64 = 1 << 34;

fn bulkhead(dedup: bool) -> LlmBulkhead {
    let builder = LlmBulkhead::builder("claude-sonnet-4", SLOTS as usize)
        .token_budget(TokenBudget::new(BUDGET));
    let builder = if dedup {
        builder.deduplication(Deduplication::new())
    } else {
        builder
    };
    builder.build().expect("valid configuration")
}

/// Reservation of every case: 100 input + 1000 max output (nothing is estimated).
fn options() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"))
}

/// One user message of 2,000 ASCII characters (the estimate bench's prose).
fn request_2000() -> LlmRequest {
    let sentence = "The bulkhead admits a call only when a slot and its tokens are free. ";
    LlmRequest::new().user(sentence.repeat(2000 / sentence.len() + 1)[..2000].to_owned())
}

/// Polls `future` once with a no-op waker.
fn poll_once<F: Future + ?Sized>(future: Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

/// The callback of every call that finishes: ready at once.
async fn answer(_ctx: RunContext<'_>) -> Result<u64, Infallible> {
    Ok(1)
}

/// The callback of a leader that stays in flight: never finishes.
async fn never(_ctx: RunContext<'_>) -> Result<u64, Infallible> {
    std::future::pending().await
}

/// Makes a call's future (`call()`), polls it once, asserts that it finished with `Ok(1)`, and
/// drops it.
#[inline]
fn round_trip<F: Future<Output = Result<u64, RunError<Infallible>>>>(call: impl FnOnce() -> F) {
    let polled = poll_once(pin!(call()));
    assert!(matches!(polled, Poll::Ready(Ok(1))), "finished in one poll");
    drop(black_box(polled));
}

/// A request and the counter that makes each of its uses a new key.
struct Fresh(LlmRequest, u64);

impl Fresh {
    /// The request with the next `max_tokens`.
    #[inline]
    fn next(&mut self) -> &LlmRequest {
        self.1 += 1;
        self.0.max_tokens = Some(self.1);
        &self.0
    }
}

fn unique_key(c: &mut Criterion) {
    let opts = options();
    let mut group = c.benchmark_group("dedup_unique_key");
    group.throughput(Throughput::Elements(1));
    // Every case gives the request a new `max_tokens` first: a new key for the deduplicated
    // call, the same small write for the others.
    let mut fresh = Fresh(request_2000(), 0);

    let plain = bulkhead(false);
    group.bench_function("run", |b| {
        b.iter(|| round_trip(|| plain.run(black_box(fresh.next()), black_box(opts), answer)))
    });
    let dedup = bulkhead(true);
    group.bench_function("run_shared_unique_key", |b| {
        b.iter(|| round_trip(|| dedup.run_shared(black_box(fresh.next()), black_box(opts), answer)))
    });
    let solo = opts.no_dedup();
    group.bench_function("run_shared_no_dedup", |b| {
        b.iter(|| round_trip(|| dedup.run_shared(black_box(fresh.next()), black_box(solo), answer)))
    });
    group.finish();

    // Every deduplicated call led (no key repeated while in flight) and was settled.
    let stats = dedup.stats();
    let figures = stats.deduplication.expect("deduplication is on");
    assert_eq!((figures.active, figures.hits), (0, 0));
    assert_eq!(stats.in_flight, 0);
}

/// A leader's `run_shared` future, boxed as `dyn` so that the closure making the leaders (which
/// also rewrites the request) can return it: the future's own type names the borrows of the
/// call that made it (the bulkhead, the request), although it holds none.
type Leader = Pin<Box<dyn Future<Output = Result<u64, RunError<Infallible>>> + Send>>;

fn follower_join(c: &mut Criterion) {
    let mut group = c.benchmark_group("dedup_follower_join");
    group.throughput(Throughput::Elements(1));
    for keys in [10u64, 10_000] {
        let bulkhead = bulkhead(true);
        let opts = options();
        // Key `k` is this request with `max_tokens` = k.
        let mut request = LlmRequest::new().user("What is a bulkhead?");
        // The leaders: admitted, their callbacks pending forever, alive until the case ends.
        let leaders: Vec<Leader> = (0..keys)
            .map(|key| {
                request.max_tokens = Some(key);
                let mut leader: Leader = Box::pin(bulkhead.run_shared(&request, opts, never));
                assert!(poll_once(leader.as_mut()).is_pending(), "admitted, waiting");
                leader
            })
            .collect();
        let stats = bulkhead.stats();
        assert_eq!(stats.in_flight, keys);
        assert_eq!(stats.deduplication.expect("on").active, keys);

        let mut next = 0u64;
        let mut ran = false;
        group.bench_function(BenchmarkId::from_parameter(format!("{keys}_keys")), |b| {
            ran = true;
            b.iter(|| {
                request.max_tokens = Some(next);
                next += 1;
                if next == keys {
                    next = 0;
                }
                // Joins the leader's flight when the call is made, leaves it when dropped
                // (unpolled).
                drop(black_box(bulkhead.run_shared(
                    black_box(&request),
                    black_box(opts),
                    answer,
                )))
            })
        });

        // Every call joined a leader in flight and left it before its first poll (a follower's
        // cancellation, counted as `aborted`); the leaders are untouched.
        let stats = bulkhead.stats();
        let figures = stats.deduplication.expect("on");
        assert_eq!(figures.active, keys);
        // (A case a filter skipped made no follower.)
        assert!(figures.hits > 0 || !ran, "the followers joined");
        assert_eq!((stats.admitted, stats.in_flight), (keys, keys));
        assert_eq!(stats.rejected, figures.hits);
        assert_eq!(stats.rejected_by_reason.aborted, figures.hits);
        drop(leaders);
        assert_eq!(bulkhead.stats().in_flight, 0);
    }
    group.finish();
}

fn observe_admitted(c: &mut Criterion) {
    let request = LlmRequest::new();
    let mut group = c.benchmark_group("observe_admitted");
    group.throughput(Throughput::Elements(1));
    let bulkhead = bulkhead(false);
    let opts = options();
    group.bench_function("run", |b| {
        b.iter(|| round_trip(|| bulkhead.run(black_box(&request), black_box(opts), answer)))
    });
    let observed = opts.observe(ShadowReasons::ALL);
    group.bench_function("run_observe_all", |b| {
        b.iter(|| round_trip(|| bulkhead.run(black_box(&request), black_box(observed), answer)))
    });
    group.finish();

    // Every observed call was admitted: none was bypassed.
    let stats = bulkhead.stats();
    assert!(stats.observe.is_none());
    assert_eq!(stats.in_flight, 0);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(40);
    targets = unique_key, follower_join, observe_admitted
}
criterion_main!(benches);
