//! Rate windows (requests and tokens per window) on a manual clock: exact bursts and steady
//! rates, exact `retry_after`, one decision with the limits in flight (a refusal by either
//! takes nothing), give-backs on every refusal after a charge (the word's, a wait's end, a
//! tenant's global refusal), the tokens window following reported usage, versioned changes,
//! typed errors that change nothing, the refusal's status and body, and threads that never get
//! more through than the window allows.

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, RejectReason, Reservation,
    TokenBudget, TokenUsage,
    builder::ConfigError,
    limits::LimitsError,
    rate::{ManualClock, RateClock, RateLimits},
    rejection::Scope,
};

mod classes;
mod latency;

const SECOND: Duration = Duration::from_secs(1);

fn windowed(max: usize, rate: RateLimits, clock: &ManualClock) -> LlmBulkhead {
    LlmBulkhead::builder("m", max)
        .max_queue(4)
        .token_budget(TokenBudget::new(1_000_000))
        .rate_limits(rate)
        .rate_clock(RateClock::manual(clock))
        .build()
        .unwrap()
}

fn tokens(n: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(n, 0).unwrap())
}

/// Admits a call of `n` tokens through door `door % 3` (`try_acquire`'s lane, the general path
/// of `try_acquire_owned`, an awaited acquire's first poll) and releases it at once.
fn through_door(
    bulkhead: &LlmBulkhead,
    request: &LlmRequest,
    n: u64,
    door: u64,
) -> Result<(), AcquireError> {
    match door % 3 {
        0 => bulkhead.try_acquire(request, tokens(n)).map(drop),
        1 => bulkhead.try_acquire_owned(request, tokens(n)).map(drop),
        _ => futures::executor::block_on(bulkhead.acquire(request, tokens(n))).map(drop),
    }
}

fn rate_refusal(error: &AcquireError) -> (bool, Option<Duration>) {
    let rejection = error.rejection().expect("a capacity refusal");
    assert_eq!(rejection.reason(), RejectReason::RateLimit, "{error}");
    (
        error.to_string().contains("tokens window"),
        rejection.retry_after(),
    )
}

#[test]
fn a_requests_window_lets_a_burst_through_then_one_per_share_of_the_window() {
    let clock = ManualClock::new();
    // 3 requests per second: an emission interval of 333,333,333.3 ns, not a whole number.
    let bulkhead = windowed(16, RateLimits::new(SECOND).requests(3), &clock);
    let request = LlmRequest::new();
    for _ in 0..3 {
        drop(bulkhead.try_acquire(&request, tokens(1)).unwrap());
    }
    let err = bulkhead.try_acquire(&request, tokens(1)).unwrap_err();
    // The fourth fits at the start of the next share: 1/3 s (in milliseconds, rounded up).
    assert_eq!(
        rate_refusal(&err),
        (false, Some(Duration::from_millis(334)))
    );
    assert_eq!(err.rejection().unwrap().http_status(), 429);
    clock.advance(Duration::from_nanos(333_333_333));
    assert!(bulkhead.try_acquire(&request, tokens(1)).is_err());
    clock.advance(Duration::from_nanos(1));
    drop(bulkhead.try_acquire(&request, tokens(1)).unwrap());
    // A quiet window refills it whole: a burst of exactly 3 again, not 4.
    clock.advance(Duration::from_secs(5));
    for _ in 0..3 {
        drop(bulkhead.try_acquire(&request, tokens(1)).unwrap());
    }
    assert!(bulkhead.try_acquire(&request, tokens(1)).is_err());
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.admitted, stats.rejected_by_reason.rate_limit),
        (7, 3)
    );
}

#[test]
fn over_a_long_run_a_window_admits_its_rate_and_no_more() {
    let clock = ManualClock::new();
    let bulkhead = windowed(16, RateLimits::per_minute().requests(600), &clock);
    let request = LlmRequest::new();
    let mut admitted = 0u64;
    // 10 minutes in steps of 7 ms, trying 3 calls a step (far above 10 a second).
    for _ in 0..(600_000 / 7) {
        for _ in 0..3 {
            if bulkhead.try_acquire(&request, tokens(1)).is_ok() {
                admitted += 1;
            }
        }
        clock.advance(Duration::from_millis(7));
    }
    // The first burst (600) plus 10 a second for the 599.998 s that followed.
    let elapsed_ms = (600_000 / 7) * 7 - 7;
    let bound = 600 + elapsed_ms * 600 / 60_000;
    assert!(admitted <= bound + 1, "{admitted} > {bound}");
    assert!(admitted >= bound - 1, "{admitted} < {bound}");
}

#[test]
fn a_tokens_window_charges_reservations_and_follows_reported_usage() {
    let clock = ManualClock::new();
    let bulkhead = windowed(16, RateLimits::new(SECOND).tokens(10_000), &clock);
    let request = LlmRequest::new();
    let a = bulkhead.try_acquire(&request, tokens(6_000)).unwrap();
    let err = bulkhead.try_acquire(&request, tokens(6_000)).unwrap_err();
    // 2,000 short: 2,000 tokens' share of a second.
    assert_eq!(rate_refusal(&err), (true, Some(Duration::from_millis(200))));
    // Nothing taken by the refusal.
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.token_budget.unwrap().in_flight_tokens
        ),
        (1, 6_000)
    );
    // The call used 1,000 of its 6,000: the window gets 5,000 back at its release.
    a.release(Some(TokenUsage::new(600, 400).unwrap()));
    let status = bulkhead.rate_status().unwrap().tokens.unwrap();
    assert_eq!((status.limit, status.remaining), (10_000, 9_000));
    drop(bulkhead.try_acquire(&request, tokens(6_000)).unwrap()); // dropped: stays charged
    assert_eq!(
        bulkhead.rate_status().unwrap().tokens.unwrap().remaining,
        3_000
    );
    // A report beyond the reservation is charged as it arrives.
    let mut b = bulkhead.try_acquire(&request, tokens(1_000)).unwrap();
    b.report_usage(TokenUsage::new(1_000, 1_500).unwrap())
        .unwrap();
    assert_eq!(
        bulkhead.rate_status().unwrap().tokens.unwrap().remaining,
        500
    );
    b.release(None);
    assert_eq!(
        bulkhead.rate_status().unwrap().tokens.unwrap().remaining,
        500
    );
    // More than the whole window: never, answered 413.
    let never = bulkhead.try_acquire(&request, tokens(10_001)).unwrap_err();
    assert_eq!(rate_refusal(&never), (true, None));
    assert_eq!(never.rejection().unwrap().http_status(), 413);
}

#[test]
fn a_refusal_by_the_word_or_a_closed_bulkhead_gives_the_charge_back() {
    let clock = ManualClock::new();
    let bulkhead = LlmBulkhead::builder("m", 1)
        .token_budget(TokenBudget::new(1_000))
        .rate_limits(RateLimits::new(SECOND).requests(10).tokens(5_000))
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    let request = LlmRequest::new();
    let held = bulkhead.try_acquire(&request, tokens(100)).unwrap();
    let full = bulkhead.try_acquire(&request, tokens(100)).unwrap_err();
    assert_eq!(
        full.rejection().unwrap().reason(),
        RejectReason::ConcurrencyLimit
    );
    let budget = bulkhead.try_acquire(&request, tokens(2_000)).unwrap_err();
    assert_eq!(
        budget.rejection().unwrap().reason(),
        RejectReason::BudgetLimit
    );
    let status = bulkhead.rate_status().unwrap();
    assert_eq!(status.requests.unwrap().remaining, 9); // only the admitted call
    assert_eq!(status.tokens.unwrap().remaining, 4_900);
    drop(held);
    // Closed: `shutdown` before any window, even a full one.
    for _ in 0..9 {
        drop(bulkhead.try_acquire(&request, tokens(1)).unwrap());
    }
    assert_eq!(
        bulkhead
            .try_acquire(&request, tokens(1))
            .unwrap_err()
            .rejection()
            .unwrap()
            .reason(),
        RejectReason::RateLimit
    );
    bulkhead.close();
    assert_eq!(
        bulkhead
            .try_acquire(&request, tokens(1))
            .unwrap_err()
            .rejection()
            .unwrap()
            .reason(),
        RejectReason::Shutdown
    );
    // Closed with room in the windows: `shutdown` on every door, and nothing stays charged.
    clock.advance(SECOND);
    let owned = bulkhead.try_acquire_owned(&request, tokens(1)).unwrap_err();
    assert_eq!(owned.rejection().unwrap().reason(), RejectReason::Shutdown);
    let plain = bulkhead.try_acquire(&request, tokens(1)).unwrap_err();
    assert_eq!(plain.rejection().unwrap().reason(), RejectReason::Shutdown);
    let status = bulkhead.rate_status().unwrap();
    assert_eq!(status.requests.unwrap().remaining, 10);
    assert_eq!(status.tokens.unwrap().remaining, 5_000);
}

#[test]
fn a_queued_call_keeps_its_charge_and_gets_it_back_when_its_wait_ends_refused() {
    let clock = ManualClock::new();
    let bulkhead = windowed(1, RateLimits::new(SECOND).requests(10), &clock);
    let request = LlmRequest::new();
    let held = bulkhead.try_acquire(&request, tokens(1)).unwrap();
    let short = tokens(1).timeout(Duration::from_millis(20));
    let err = bulkhead.acquire_blocking(&request, short).unwrap_err();
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::Timeout);
    assert_eq!(
        bulkhead.rate_status().unwrap().requests.unwrap().remaining,
        9
    );
    // Handed the slot: it stays charged.
    let waiter = std::thread::scope(|scope| {
        let waiting = scope.spawn(|| bulkhead.acquire_blocking(&request, tokens(1)).map(drop));
        while bulkhead.stats().pending == 0 {
            std::thread::yield_now();
        }
        assert_eq!(
            bulkhead.rate_status().unwrap().requests.unwrap().remaining,
            8
        );
        drop(held);
        waiting.join().unwrap()
    });
    waiter.unwrap();
    assert_eq!(
        bulkhead.rate_status().unwrap().requests.unwrap().remaining,
        8
    );
}

#[test]
fn under_threads_windows_rescaled_by_limit_changes_keep_every_charge() {
    // A frozen clock (nothing drains) and windows far from binding: while three threads admit
    // through every door, a fourth changes the windows' limits back and forth. Every unit
    // charged stays charged across every rescale, so the window ends exactly at what was
    // admitted.
    let clock = ManualClock::new();
    let bulkhead = windowed(
        64,
        RateLimits::new(SECOND)
            .requests(1_000_000)
            .tokens(100_000_000),
        &clock,
    );
    let admitted = AtomicU64::new(0);
    let admitted_tokens = AtomicU64::new(0);
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for seed in 0..3u64 {
            let (bulkhead, admitted, admitted_tokens) = (&bulkhead, &admitted, &admitted_tokens);
            let start = &start;
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(seed);
                let request = LlmRequest::new();
                start.wait();
                for i in 0..3_000u64 {
                    let n = rng.u64(1..120);
                    through_door(bulkhead, &request, n, seed + i).expect("far from every limit");
                    admitted.fetch_add(1, Ordering::Relaxed);
                    admitted_tokens.fetch_add(n, Ordering::Relaxed);
                }
            });
        }
        scope.spawn(|| {
            // At least 100 changes, until the admitters are done, and an even number (back at
            // the start).
            start.wait();
            let mut revision = 0u64;
            while revision < 100 || admitted.load(Ordering::Relaxed) < 9_000 || revision % 2 == 1 {
                revision += 1;
                let mut next = bulkhead.limits();
                next.revision = revision;
                let scale = 1 + revision % 2;
                next.rate = Some(
                    RateLimits::new(SECOND)
                        .requests(1_000_000 * scale)
                        .tokens(100_000_000 * scale),
                );
                assert!(bulkhead.apply_limits(next).unwrap().is_applied());
            }
        });
    });
    let (calls, used) = (admitted.into_inner(), admitted_tokens.into_inner());
    assert_eq!(calls, 9_000);
    let status = bulkhead.rate_status().unwrap();
    let (requests, tokens) = (status.requests.unwrap(), status.tokens.unwrap());
    assert_eq!((requests.limit, tokens.limit), (1_000_000, 100_000_000));
    assert_eq!(requests.remaining, 1_000_000 - calls);
    assert_eq!(tokens.remaining, 100_000_000 - used);
    assert_eq!(bulkhead.stats().in_flight, 0);
}

#[test]
fn an_awaited_acquire_is_charged_on_its_first_poll_and_never_passes_a_waiter() {
    let clock = ManualClock::new();
    let bulkhead = windowed(
        1,
        RateLimits::new(SECOND).requests(10).tokens(1_000),
        &clock,
    );
    let request = LlmRequest::new();
    let remaining = || {
        let status = bulkhead.rate_status().unwrap();
        (
            status.requests.unwrap().remaining,
            status.tokens.unwrap().remaining,
        )
    };
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    // Admitted at its first poll (the windowed lane), and charged.
    let held = futures::executor::block_on(bulkhead.acquire(&request, tokens(100))).unwrap();
    assert_eq!(remaining(), (9, 900));
    // No slot: it queues, keeping its charge.
    let mut first = Box::pin(bulkhead.acquire(&request, tokens(200)));
    assert!(first.as_mut().poll(&mut cx).is_pending());
    assert_eq!(remaining(), (8, 700));
    // The slot comes back while the first waits: it is the first's, not a newcomer's.
    drop(held);
    let mut second = Box::pin(bulkhead.acquire(&request, tokens(50)));
    assert!(second.as_mut().poll(&mut cx).is_pending());
    assert_eq!(remaining(), (7, 650));
    let std::task::Poll::Ready(first) = first.as_mut().poll(&mut cx) else {
        panic!("the head of the queue was handed the slot");
    };
    drop(first.unwrap());
    let std::task::Poll::Ready(second) = second.as_mut().poll(&mut cx) else {
        panic!("the next waiter was handed the slot");
    };
    drop(second.unwrap());
    assert_eq!(remaining(), (7, 650));
    assert_eq!(bulkhead.stats().admitted, 3);
}

#[test]
fn limits_change_the_window_through_the_versioned_path_and_bad_ones_change_nothing() {
    let clock = ManualClock::new();
    let bulkhead = windowed(16, RateLimits::new(SECOND).requests(2), &clock);
    let request = LlmRequest::new();
    drop((
        bulkhead.try_acquire(&request, tokens(1)).unwrap(),
        bulkhead.try_acquire(&request, tokens(1)).unwrap(),
    ));
    assert!(bulkhead.try_acquire(&request, tokens(1)).is_err());
    let mut next = bulkhead.limits();
    next.revision = 1;
    next.rate = Some(RateLimits::new(SECOND).requests(4));
    assert!(bulkhead.apply_limits(next.clone()).unwrap().is_applied());
    // The same instant on the new scale: 2 of 4 used, 2 left.
    assert_eq!(
        bulkhead.rate_status().unwrap().requests.unwrap().remaining,
        2
    );
    drop(bulkhead.try_acquire(&request, tokens(1)).unwrap());
    for (rate, error) in [
        (None, LimitsError::RateLimitsRequired),
        (
            Some(RateLimits::new(Duration::ZERO).requests(1)),
            LimitsError::RateWindowOutOfRange {
                window: Duration::ZERO,
            },
        ),
        (Some(RateLimits::new(SECOND)), LimitsError::RateLimitsEmpty),
        (
            Some(RateLimits::new(SECOND).requests(0)),
            LimitsError::RateLimitsEmpty,
        ),
        (
            Some(RateLimits::new(Duration::from_millis(1)).requests(2_000_000)),
            LimitsError::RateLimitTooHigh {
                limit: 2_000_000,
                window: Duration::from_millis(1),
            },
        ),
    ] {
        let mut bad = next.clone();
        bad.revision = 2;
        bad.rate = rate;
        assert_eq!(bulkhead.apply_limits(bad).unwrap_err(), error);
    }
    assert_eq!(bulkhead.limits().revision, 1);
    let plain = LlmBulkhead::builder("m", 1).build().unwrap();
    let err = plain
        .apply_limits(Limits::new(1, 1).with_rate(RateLimits::new(SECOND).requests(1)))
        .unwrap_err();
    assert_eq!(err, LimitsError::RateLimitsNotConfigured);
    let err = LlmBulkhead::builder("m", 1)
        .rate_limits(RateLimits::new(SECOND).tokens(5))
        .build()
        .unwrap_err();
    assert_eq!(
        err,
        ConfigError::RateLimits(LimitsError::RateTokensNeedBudget)
    );
}

#[test]
fn a_tenant_window_refuses_at_the_tenant_and_a_global_refusal_gives_the_tenant_charge_back() {
    let clock = ManualClock::new();
    let global = LlmBulkhead::builder("m", 1).build().unwrap();
    let tenant = LlmBulkhead::builder("m", 8)
        .rate_limits(RateLimits::new(SECOND).requests(2))
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    let request = LlmRequest::new();
    let held = tenant
        .try_acquire_within(&global, &request, AcquireOptions::new())
        .unwrap();
    // The global slot is taken: refused globally, the tenant's window charge given back.
    let err = tenant
        .try_acquire_within(&global, &request, AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err.rejection().unwrap().scope(), Some(Scope::Global));
    assert_eq!(tenant.rate_status().unwrap().requests.unwrap().remaining, 1);
    drop(held);
    drop(
        tenant
            .try_acquire_within(&global, &request, AcquireOptions::new())
            .unwrap(),
    );
    let err = tenant
        .try_acquire_within(&global, &request, AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err.rejection().unwrap().scope(), Some(Scope::Tenant));
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::RateLimit);
    assert_eq!(global.stats().admitted, 2);
}

#[cfg(feature = "serde")]
#[test]
fn rate_limits_are_data_in_limits_and_tenant_policies() {
    use async_bulkhead_llm::tenants::TenantPolicy;
    let limits = Limits::new(1, 8).with_rate(RateLimits::per_minute().requests(500).tokens(90_000));
    let json = serde_json::to_string(&limits).unwrap();
    assert!(
        json.contains(r#""rate":{"window_ms":60000,"requests":500,"tokens":90000}"#),
        "{json}"
    );
    assert_eq!(serde_json::from_str::<Limits>(&json).unwrap(), limits);
    let policy: TenantPolicy = serde_json::from_str(
        r#"{"revision": 1, "default": {"max_concurrent": 2, "rate": {"window_ms": 1000, "requests": 5}}}"#,
    )
    .unwrap();
    assert_eq!(policy.limits_for("x").rate.unwrap().requests, Some(5));
    // The refusal's body carries the wait.
    let clock = ManualClock::new();
    let bulkhead = windowed(4, RateLimits::new(SECOND).requests(1), &clock);
    drop(bulkhead.try_acquire(&LlmRequest::new(), tokens(1)).unwrap());
    let err = bulkhead
        .try_acquire(&LlmRequest::new(), tokens(1))
        .unwrap_err();
    let json = serde_json::to_value(err.rejection().unwrap()).unwrap();
    assert_eq!(
        (
            json["reason"].as_str(),
            json["retry_after_ms"].as_u64(),
            json["rate_window"].as_str()
        ),
        (Some("rate_limit"), Some(1000), Some("requests"))
    );
    // A class's windows are data too.
    let class: async_bulkhead_llm::classes::ClassLimits = serde_json::from_str(
        r#"{"max_concurrent": 4, "rate": {"window_ms": 60000, "tokens": 40000}}"#,
    )
    .unwrap();
    assert_eq!(class.rate, Some(RateLimits::per_minute().tokens(40_000)));
    assert_eq!(
        serde_json::to_string(&class).unwrap(),
        r#"{"max_concurrent":4,"rate":{"window_ms":60000,"requests":null,"tokens":40000}}"#
    );
    let body = async_bulkhead_llm::http::HttpRefusal::from(err).body();
    assert!(
        body.contains(r#""type":"rate_limit_error","code":"rate_limit""#),
        "{body}"
    );
}

#[cfg(feature = "tokio")]
#[tokio::test(start_paused = true)]
async fn the_tokio_clock_follows_a_paused_runtime() {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .rate_limits(RateLimits::new(SECOND).requests(1))
        .rate_clock(RateClock::tokio())
        .build()
        .unwrap();
    drop(
        bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap(),
    );
    let err = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap_err();
    assert_eq!(err.rejection().unwrap().retry_after(), Some(SECOND));
    tokio::time::advance(SECOND).await;
    assert!(
        bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .is_ok()
    );
}

/// Four threads hammer a frozen window of 1,000 requests and 50,000 tokens: exactly what it
/// allows gets through, whatever the interleaving, and every refusal gave its charge back.
#[test]
fn under_threads_a_frozen_window_admits_exactly_its_limit() {
    let clock = ManualClock::new();
    let bulkhead = windowed(
        64,
        RateLimits::new(SECOND).requests(1_000).tokens(50_000),
        &clock,
    );
    let admitted = AtomicU64::new(0);
    let admitted_tokens = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for seed in 0..4 {
            let (bulkhead, admitted, admitted_tokens) = (&bulkhead, &admitted, &admitted_tokens);
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(seed);
                let request = LlmRequest::new();
                for i in 0..5_000u64 {
                    let n = rng.u64(1..120);
                    if through_door(bulkhead, &request, n, seed + i).is_ok() {
                        admitted.fetch_add(1, Ordering::Relaxed);
                        admitted_tokens.fetch_add(n, Ordering::Relaxed);
                    }
                }
            });
        }
    });
    let (calls, used) = (admitted.into_inner(), admitted_tokens.into_inner());
    assert!(
        calls <= 1_000 && used <= 50_000,
        "{calls} calls, {used} tokens"
    );
    let status = bulkhead.rate_status().unwrap();
    assert_eq!(status.requests.unwrap().remaining, 1_000 - calls);
    assert_eq!(status.tokens.unwrap().remaining, 50_000 - used);
    assert_eq!(
        bulkhead.stats().rejected_by_reason.rate_limit,
        20_000 - calls
    );
}

/// A provider's own limits, as OpenAI states them: a token bucket per minute for requests and
/// one for tokens (capacity the limit, refilled continuously), each request charged its input
/// and `max_tokens` on arrival; a request that does not fit is answered 429. Exact arithmetic
/// of its own (continuous time, not ticks).
struct Provider {
    rpm: f64,
    tpm: f64,
    requests: f64,
    tokens: f64,
    at: Duration,
    accepted_tokens: u64,
    too_many: u64,
}

impl Provider {
    fn new(rpm: u64, tpm: u64) -> Provider {
        Provider {
            rpm: rpm as f64,
            tpm: tpm as f64,
            requests: rpm as f64,
            tokens: tpm as f64,
            at: Duration::ZERO,
            accepted_tokens: 0,
            too_many: 0,
        }
    }

    fn call(&mut self, now: Duration, tokens: u64) {
        let minutes = (now - self.at).as_secs_f64() / 60.0;
        self.at = now;
        self.requests = (self.requests + minutes * self.rpm).min(self.rpm);
        self.tokens = (self.tokens + minutes * self.tpm).min(self.tpm);
        // A millionth of a token of slack for floating point.
        if self.requests + 1e-6 >= 1.0 && self.tokens + 1e-6 >= tokens as f64 {
            self.requests -= 1.0;
            self.tokens -= tokens as f64;
            self.accepted_tokens += tokens;
        } else {
            self.too_many += 1;
        }
    }
}

/// Ten virtual minutes of demand far above a provider's 120 RPM / 100,000 TPM, through a
/// bulkhead whose windows are set to the provider's limits: the provider answers no 429, and
/// the bulkhead passes it at least 95% of the tokens it could take.
#[test]
fn windows_set_to_the_provider_s_limits_meet_no_429_and_use_its_tokens() {
    const RPM: u64 = 120;
    const TPM: u64 = 100_000;
    let clock = ManualClock::new();
    let bulkhead = LlmBulkhead::builder("m", 1_000)
        .token_budget(TokenBudget::new(10_000_000))
        .rate_limits(RateLimits::per_minute().requests(RPM).tokens(TPM))
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    let mut provider = Provider::new(RPM, TPM);
    let mut rng = fastrand::Rng::with_seed(32);
    let mut running: Vec<(Duration, async_bulkhead_llm::Permit<'_>)> = Vec::new();
    let step = Duration::from_millis(10);
    let mut now = Duration::ZERO;
    let mut refused = 0u64;
    while now < Duration::from_secs(600) {
        // Twenty clients a step, each wanting 200-3,000 tokens.
        for _ in 0..20 {
            let reserved = rng.u64(200..3_000);
            match bulkhead.try_acquire(&LlmRequest::new(), tokens(reserved)) {
                Ok(permit) => {
                    provider.call(now, reserved);
                    running.push((now + Duration::from_millis(rng.u64(500..8_000)), permit));
                }
                Err(_) => refused += 1,
            }
        }
        // Calls that end settle with their reservation (what the provider charged).
        running.retain_mut(|(end, _)| *end > now);
        clock.advance(step);
        now += step;
    }
    // The most the provider could take: a full bucket, then its rate, over ten minutes.
    let most = TPM + TPM * 10;
    let used = provider.accepted_tokens as f64 / most as f64;
    assert_eq!(provider.too_many, 0, "provider 429s");
    assert!(
        used >= 0.95,
        "used {:.1}% of the provider's tokens",
        used * 100.0
    );
    assert!(refused > 100_000, "the demand was far above the limits");
    println!(
        "provider 429s: 0; tokens used: {:.2}% of {most}; bulkhead refusals: {refused}",
        used * 100.0
    );
}

/// Drives `minutes` of demand far above the provider's limits through `bulkhead`, telling
/// `learner` what each provider answer said (with the limits stated when `states` is set); at
/// each `(at, tpm)` of `changes` the provider's tokens limit changes. Returns the bulkhead's
/// tokens window sampled every second, and the provider's accepted tokens and 429s per second.
fn learn_against(
    bulkhead: &LlmBulkhead,
    clock: &ManualClock,
    learner: &async_bulkhead_llm::rate::LimitLearner,
    provider: &mut Provider,
    seconds: u64,
    states: bool,
    changes: &[(u64, u64)],
) -> Vec<(u64, u64, u64)> {
    use async_bulkhead_llm::rate::ProviderLimits;
    let mut rng = fastrand::Rng::with_seed(7);
    let step = Duration::from_millis(10);
    let mut now = Duration::ZERO;
    let mut samples = Vec::new();
    let (mut accepted, mut throttled) = (0u64, 0u64);
    while now < Duration::from_secs(seconds) {
        if let Some(&(_, tpm)) = changes
            .iter()
            .find(|(at, _)| Duration::from_secs(*at) == now)
        {
            provider.tpm = tpm as f64;
            provider.tokens = provider.tokens.min(provider.tpm);
        }
        for _ in 0..20 {
            let reserved = rng.u64(200..3_000);
            if let Ok(permit) = bulkhead.try_acquire(&LlmRequest::new(), tokens(reserved)) {
                let (before, too_many) = (provider.accepted_tokens, provider.too_many);
                provider.call(now, reserved);
                accepted += provider.accepted_tokens - before;
                throttled += provider.too_many - too_many;
                let mut seen = if provider.too_many > too_many {
                    ProviderLimits::throttled()
                } else {
                    ProviderLimits::new()
                }
                .admitted_under(permit.limit_revision());
                if states {
                    seen = seen.limit_tokens(provider.tpm as u64);
                }
                learner.observe(seen);
                drop(permit);
            }
        }
        clock.advance(step);
        now += step;
        if now.as_millis().is_multiple_of(1000) {
            let window = bulkhead.limits().rate.unwrap().tokens.unwrap();
            samples.push((window, accepted, throttled));
            (accepted, throttled) = (0, 0);
        }
    }
    samples
}

fn learning_bulkhead(clock: &ManualClock) -> LlmBulkhead {
    LlmBulkhead::builder("m", 1_000)
        .token_budget(TokenBudget::new(10_000_000))
        .rate_limits(RateLimits::per_minute().tokens(1_000_000))
        .rate_clock(RateClock::manual(clock))
        .build()
        .unwrap()
}

/// A provider that states its limit in its headers: the learned window is its limit after the
/// first answer, and again after the provider halves it, whatever was configured.
#[test]
fn a_learner_follows_the_limits_the_provider_states() {
    use async_bulkhead_llm::rate::{LearnBounds, LimitLearner};
    let clock = ManualClock::new();
    let bulkhead = learning_bulkhead(&clock);
    let learner = LimitLearner::new(bulkhead.clone()).tokens(LearnBounds::new(10_000, 2_000_000));
    let mut provider = Provider::new(1_000_000, 100_000);
    let samples = learn_against(
        &bulkhead,
        &clock,
        &learner,
        &mut provider,
        120,
        true,
        &[(60, 50_000)],
    );
    let within = |window: u64, limit: u64| window.abs_diff(limit) * 10 <= limit;
    assert!(within(samples[29].0, 100_000), "{:?}", samples[29]);
    assert!(within(samples[89].0, 50_000), "{:?}", samples[89]);
    // At steady state (from two seconds after the change) the provider throttles nothing.
    let late: u64 = samples[62..120].iter().map(|s| s.2).sum();
    assert_eq!(late, 0);
    println!(
        "stated limits: window {} at 30 s, {} at 90 s; provider 429s from 62 s to 120 s: {late}",
        samples[29].0, samples[89].0
    );
    assert!(bulkhead.limits().revision >= 2);
}

/// A provider that states nothing, only 429s: the window comes down from ten times the
/// provider's limit and settles around it (multiplicative decrease, additive increase).
#[test]
fn a_learner_settles_near_an_unstated_limit_from_429s_alone() {
    use async_bulkhead_llm::rate::{LearnBounds, LimitLearner};
    let clock = ManualClock::new();
    let bulkhead = learning_bulkhead(&clock);
    let learner = LimitLearner::new(bulkhead.clone())
        .tokens(LearnBounds::new(10_000, 2_000_000))
        .decrease(0.97)
        .increase(250, 20);
    let mut provider = Provider::new(1_000_000, 100_000);
    let samples = learn_against(
        &bulkhead,
        &clock,
        &learner,
        &mut provider,
        180,
        false,
        &[(90, 50_000)],
    );
    let report = |from: usize, to: usize, limit: f64| {
        let windows: Vec<u64> = samples[from..to].iter().map(|s| s.0).collect();
        let mean = windows.iter().sum::<u64>() as f64 / windows.len() as f64;
        let accepted =
            samples[from..to].iter().map(|s| s.1).sum::<u64>() as f64 / ((to - from) as f64 / 60.0);
        let throttled = samples[from..to].iter().map(|s| s.2).sum::<u64>();
        println!(
            "429s alone, {from}-{to} s: window mean {mean:.0} ({:.0}% of the provider's {limit}), \
             provider took {:.0}% of its limit, {throttled} 429s",
            mean / limit * 100.0,
            accepted / limit * 100.0
        );
        (mean / limit, accepted / limit)
    };
    // Measured: window means 95% and 96% of the limit, the provider's whole limit used, 2
    // and 3 provider 429s a minute (a window's room after a raise is there at once, so the
    // window's mean sits below the limit the provider's throughput reaches). With a decrease
    // of 0.95 and 500 every 20 answers: 90% and 91%; with 0.99: 101% and 107%, 20 429s a
    // minute.
    let (window, used) = report(30, 90, 100_000.0);
    assert!(
        (0.9..=1.1).contains(&window),
        "window at {window:.2} of the limit"
    );
    assert!(used >= 0.95, "the provider took {used:.2} of its limit");
    let (window, used) = report(120, 180, 50_000.0);
    assert!(
        (0.9..=1.1).contains(&window),
        "window at {window:.2} of the halved limit"
    );
    assert!(
        used >= 0.95,
        "the provider took {used:.2} of its halved limit"
    );
}

/// The in-flight budget learned from throttling answers alone, never past its bounds, each
/// change a new revision; a window without bounds is left as configured.
#[test]
fn a_learned_budget_stays_within_its_bounds() {
    use async_bulkhead_llm::rate::{LearnBounds, LimitLearner, ProviderLimits};
    let bulkhead = LlmBulkhead::builder("m", 8)
        .token_budget(TokenBudget::new(100_000))
        .rate_limits(RateLimits::per_minute().requests(600))
        .build()
        .unwrap();
    let learner = LimitLearner::new(bulkhead.clone())
        .budget(LearnBounds::new(30_000, 120_000))
        .increase(10_000, 2);
    let budget = || bulkhead.limits().token_budget.unwrap().budget;
    for expected in [70_000, 49_000, 34_300, 30_000, 30_000] {
        learner.observe(ProviderLimits::throttled());
        assert_eq!(budget(), expected);
    }
    let revision = bulkhead.limits().revision;
    assert_eq!(revision, 4, "the floor reached, nothing more to change");
    for _ in 0..40 {
        learner.observe(ProviderLimits::new());
    }
    assert_eq!(budget(), 120_000);
    assert_eq!(bulkhead.limits().rate.unwrap().requests, Some(600));
}

/// Usage charged far beyond a window's limit makes a wait longer than any window: told
/// exactly (in whole seconds beyond about 1.55 days), so a call that waits that long fits. (It
/// was capped at about 3.1 days, and a call that waited that long was refused again.)
#[test]
fn a_wait_longer_than_any_window_is_told_exactly() {
    let clock = ManualClock::new();
    let bulkhead = windowed(4, RateLimits::new(SECOND).tokens(1_000), &clock);
    let request = LlmRequest::new();
    let permit = bulkhead.try_acquire(&request, tokens(100)).unwrap();
    permit.release(Some(TokenUsage::new(0, 1_000_000_000).unwrap()));
    let refused = bulkhead.try_acquire(&request, tokens(1)).unwrap_err();
    // 999,999,001 ms (the window's 1,000 tokens a second), rounded up to whole seconds.
    let wait = refused.rejection().unwrap().retry_after().unwrap();
    assert_eq!(wait, Duration::from_secs(1_000_000));
    assert_eq!(
        bulkhead.rate_status().unwrap().tokens.unwrap().reset,
        Duration::from_secs(1_000_000)
    );
    clock.advance(wait - Duration::from_secs(1));
    assert!(bulkhead.try_acquire(&request, tokens(1)).is_err());
    clock.advance(Duration::from_secs(1));
    assert!(bulkhead.try_acquire(&request, tokens(1)).is_ok());
    // Within a day and a half, still milliseconds: 1,000 tokens more is one second.
    let bulkhead = windowed(4, RateLimits::new(SECOND).tokens(1_000), &clock);
    drop(bulkhead.try_acquire(&request, tokens(1_000)).unwrap());
    let refused = bulkhead.try_acquire(&request, tokens(1)).unwrap_err();
    assert_eq!(
        refused.rejection().unwrap().retry_after(),
        Some(Duration::from_millis(1))
    );
}

/// `would_admit` judges the windows as an admission does (before the limits in flight,
/// `shutdown` first), charging nothing.
#[test]
fn would_admit_sees_the_windows_and_charges_nothing() {
    use async_bulkhead_llm::admission::Verdict;
    let clock = ManualClock::new();
    let bulkhead = windowed(1, RateLimits::new(SECOND).requests(2), &clock);
    let request = LlmRequest::new();
    let remaining = || bulkhead.rate_status().unwrap().requests.unwrap().remaining;
    assert_eq!(
        bulkhead.would_admit(&request, tokens(1)).unwrap(),
        Verdict::Admit
    );
    assert_eq!(remaining(), 2);
    let held = bulkhead.try_acquire(&request, tokens(1)).unwrap();
    // The slot is taken, the window has room: the call would queue.
    assert_eq!(
        bulkhead.would_admit(&request, tokens(1)).unwrap(),
        Verdict::Queue
    );
    drop(held);
    drop(bulkhead.try_acquire(&request, tokens(1)).unwrap());
    assert_eq!(
        bulkhead.would_admit(&request, tokens(1)).unwrap(),
        Verdict::Reject(RejectReason::RateLimit)
    );
    assert_eq!(remaining(), 0);
    bulkhead.close();
    assert_eq!(
        bulkhead.would_admit(&request, tokens(1)).unwrap(),
        Verdict::Reject(RejectReason::Shutdown)
    );
}
