//! Global rate windows (exact mode) against a real redis-server: exact bursts and retry-after
//! on Redis's clock, two replicas sharing one window, the tokens window corrected by usage,
//! refusals that take nothing, configuration errors, and the failure policy's floor.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_bulkhead_llm::rate::{RateLimits, RateWindow};
use async_bulkhead_llm::{LlmRequest, RejectReason, TokenUsage};
use async_bulkhead_llm_redis::{
    ConfigError, ExactLedger, FailurePolicy, LeasedLedger, LedgerConfig, LedgerError,
    LedgerRefusal, max_rate_limit,
};
use common::{RedisServer, bulkhead, observe, opened, reserve};

fn config(server: &RedisServer, ns: &str, id: &str, budget: u64, rate: RateLimits) -> LedgerConfig {
    LedgerConfig::new(server.url(), ns, budget)
        .replica_id(id)
        .lease(Duration::from_secs(5))
        .rate_limits(rate)
}

async fn replica(
    server: &RedisServer,
    ns: &str,
    id: &str,
    budget: u64,
    rate: RateLimits,
) -> ExactLedger {
    ExactLedger::connect(bulkhead(budget), config(server, ns, id, budget, rate))
        .await
        .unwrap()
}

/// The tokens window's raw state in Redis: (anchor in us, tat in ticks since it).
fn tokens_window(c: &mut redis::Connection, ns: &str) -> (u64, u64) {
    let v: Vec<Option<u64>> = redis::cmd("HMGET")
        .arg(format!("{ns}:rate"))
        .arg("to")
        .arg("ttat")
        .query(c)
        .unwrap();
    (v[0].unwrap(), v[1].unwrap())
}

fn requests_tat(c: &mut redis::Connection, ns: &str) -> Option<u64> {
    redis::cmd("HGET")
        .arg(format!("{ns}:rate"))
        .arg("rtat")
        .query(c)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_in_ten_seconds_admit_five_at_once_then_refuse_until_2_s_after_the_first() {
    let server = RedisServer::start();
    let ns = "{burst}";
    // A tick of 2 s: the checks below that the window has not moved yet (its timestamp, a
    // refusal after the releases) hold on a loaded machine too (with a tick of 200 ms, a
    // loaded machine could let one pass before them).
    let rate = RateLimits::new(Duration::from_secs(10)).requests(5);
    let ledger = replica(&server, ns, "a", 10_000, rate).await;
    let mut c = server.connection().unwrap();

    let started = Instant::now();
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(
            ledger
                .try_acquire(&LlmRequest::new(), reserve(10, 10))
                .await
                .unwrap(),
        );
    }
    let before = observe(&mut c, ns);
    let refused = ledger
        .try_acquire(&LlmRequest::new(), reserve(10, 10))
        .await
        .unwrap_err();
    let elapsed = started.elapsed();
    let LedgerRefusal::GlobalRate(why) = &refused else {
        panic!("a global rate refusal, got {refused:?}")
    };
    assert_eq!(refused.reason(), Some(RejectReason::RateLimit));
    assert_eq!(refused.http_status(), 429);
    assert_eq!(
        (why.window, why.requested, why.limit, why.period),
        (RateWindow::Requests, 1, 5, Duration::from_secs(10))
    );
    // The window was anchored at the first call (Redis's clock): the sixth fits 2 s after it,
    // so the wait is 2 s less what Redis's clock moved between the first call and the sixth,
    // rounded up to the millisecond: exactly 2 s unless the six scripts spanned a whole
    // millisecond (which the bound below allows, and no more).
    let retry = refused.retry_after().unwrap();
    assert_eq!(Some(retry), why.retry_after);
    // The core crate's refusal too: the same window, wait, status and body as a local one's.
    let rejection = refused.rejection().unwrap();
    assert_eq!(
        (
            rejection.reason(),
            rejection.rate_window(),
            rejection.retry_after()
        ),
        (
            RejectReason::RateLimit,
            Some(RateWindow::Requests),
            Some(retry)
        )
    );
    let answer = refused.http_refusal().unwrap();
    assert_eq!((answer.status, answer.code), (429, "rate_limit"));
    assert_eq!(
        answer.scope,
        Some(async_bulkhead_llm::rejection::Scope::Global)
    );
    let moved_ms = elapsed.as_millis() as u64;
    assert!(
        retry <= Duration::from_millis(2_000)
            && retry >= Duration::from_millis(2_000u64.saturating_sub(moved_ms)),
        "retry after {retry:?}, {elapsed:?} after the first call"
    );
    eprintln!("retry after {retry:?}; six calls took {elapsed:?}");
    // The refusal took no hold: the ledger is as it was, the local admission returned.
    assert_eq!(observe(&mut c, ns), before);
    assert_eq!((before.total, before.hold_count), (100, 5));
    assert_eq!(ledger.bulkhead().stats().in_flight, 5);
    assert_eq!(ledger.stats().refused_rate, 1);
    assert_eq!(requests_tat(&mut c, ns), Some(5));
    let status = ledger.global_rate().await.unwrap().unwrap();
    let requests = status.requests.unwrap();
    assert_eq!((requests.limit, requests.remaining), (5, 0));
    assert!(status.tokens.is_none());

    // Releasing does not give requests back; waiting does.
    for permit in held.drain(..) {
        permit.release(None);
    }
    assert!(ledger.settled(Duration::from_secs(1)).await);
    assert!(matches!(
        ledger
            .try_acquire(&LlmRequest::new(), reserve(10, 10))
            .await,
        Err(LedgerRefusal::GlobalRate(_))
    ));
    tokio::time::sleep(retry).await;
    let permit = ledger
        .try_acquire(&LlmRequest::new(), reserve(10, 10))
        .await
        .unwrap();
    permit.release(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_window() {
    const LIMIT: u64 = 20;
    const WINDOW: Duration = Duration::from_secs(1);
    const RUN: Duration = Duration::from_secs(3);
    let server = RedisServer::start();
    let ns = "{shared-window}";
    let rate = RateLimits::new(WINDOW).requests(LIMIT);
    let replicas = [
        replica(&server, ns, "a", 100_000, rate).await,
        replica(&server, ns, "b", 100_000, rate).await,
    ];
    // Each admission: when the call was sent and when its answer came back (the script
    // decided in between, on Redis's clock), and which replica admitted it.
    let admitted: Arc<Mutex<Vec<(Instant, Instant, usize)>>> = Arc::default();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (r, ledger) in replicas.iter().enumerate() {
        for _ in 0..8 {
            let (ledger, admitted) = (ledger.clone(), admitted.clone());
            tasks.push(tokio::spawn(async move {
                let mut refused = 0u64;
                while started.elapsed() < RUN {
                    let sent = Instant::now();
                    match ledger.try_acquire(&LlmRequest::new(), reserve(5, 5)).await {
                        Ok(permit) => {
                            admitted.lock().unwrap().push((sent, Instant::now(), r));
                            permit.release(None);
                        }
                        Err(LedgerRefusal::GlobalRate(why)) => {
                            refused += 1;
                            let wait = why.retry_after.unwrap();
                            tokio::time::sleep(wait.min(Duration::from_millis(20))).await;
                        }
                        Err(other) => panic!("{other:?}"),
                    }
                }
                refused
            }));
        }
    }
    let mut refused = 0;
    for task in tasks {
        refused += task.await.unwrap();
    }
    let elapsed = started.elapsed();
    let mut admitted = admitted.lock().unwrap().clone();
    admitted.sort_by_key(|&(_, received, _)| received);
    let per_replica = [0, 1].map(|r| admitted.iter().filter(|a| a.2 == r).count());
    assert!(per_replica.iter().all(|&n| n > 0), "{per_replica:?}");

    // The GCRA's bound, on the windows' ticks (W / LIMIT each): in a span of `t` on Redis's
    // clock at most LIMIT + LIMIT * t / W admissions (+1 for the tick a span starts inside).
    // Calls i..=j were decided within [sent_i, received_j] (the sent order may differ from
    // the decided order by at most one round trip; the bound is taken over that span).
    let mut worst_excess = f64::MIN;
    let (mut max_in_window, mut max_steady) = (0, 0);
    for i in 0..admitted.len() {
        for j in i..admitted.len() {
            let first_sent = admitted[i..=j].iter().map(|a| a.0).min().unwrap();
            let span = admitted[j].1.duration_since(first_sent);
            let allowed =
                LIMIT as f64 + LIMIT as f64 * span.as_secs_f64() / WINDOW.as_secs_f64() + 1.0;
            let count = (j - i + 1) as f64;
            worst_excess = worst_excess.max(count - allowed);
            assert!(
                count <= allowed,
                "{count} admissions decided within {span:?}: more than {allowed}"
            );
            if admitted[j].1.duration_since(admitted[i].1) < WINDOW {
                max_in_window = max_in_window.max(j - i + 1);
                // After the first window's burst, the steady pace: a window's worth.
                if admitted[i].1.duration_since(started) >= WINDOW {
                    max_steady = max_steady.max(j - i + 1);
                }
            }
        }
    }
    // Over the whole run: at most one window's burst plus the steady rate, shared (two
    // replicas each with its own window would have admitted twice that).
    let total = admitted.len() as u64;
    let most = LIMIT + (LIMIT as f64 * elapsed.as_secs_f64()).ceil() as u64 + 1;
    assert!(
        total <= most,
        "{total} admitted in {elapsed:?}, at most {most}"
    );
    // And the window was used: at least the steady rate over the run.
    let least = (LIMIT as f64 * RUN.as_secs_f64()) as u64;
    assert!(
        total >= least,
        "{total} admitted in {elapsed:?}, at least {least}"
    );
    eprintln!(
        "{total} admitted in {elapsed:?} ({per_replica:?} per replica), {refused} refused; \
         most in any 1 s: {max_in_window} ({max_steady} after the first second); \
         closest to the bound: {worst_excess:.2}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokens_window_follows_usage() {
    let server = RedisServer::start();
    let ns = "{usage}";
    // 100,000 tokens an hour: a tick is 36 ms. (The figures below hold while no tick drains
    // below the window's timestamp, about 10 s here: with a 600 us tick, a loaded machine
    // took the 180 ms between a charge and its give-back, and the give-back stopped at the
    // clock, as it must.)
    let rate = RateLimits::new(Duration::from_secs(3_600)).tokens(100_000);
    let ledger = replica(&server, ns, "a", 10_000, rate).await;
    let mut c = server.connection().unwrap();

    // A call reserving 1,000 tokens is charged 1,000 ticks from the anchor (its own instant).
    let mut permit = ledger
        .try_acquire(&LlmRequest::new(), reserve(200, 800))
        .await
        .unwrap();
    let (anchor, tat) = tokens_window(&mut c, ns);
    assert_eq!(tat, 1_000);
    // A report below the reservation moves nothing yet (the call may still use it) ...
    permit
        .report_usage(TokenUsage::new(200, 100).unwrap())
        .await
        .unwrap();
    assert_eq!(tokens_window(&mut c, ns), (anchor, 1_000));
    // ... its release gives the 700 it did not use back, exactly.
    permit.release(None);
    assert!(ledger.settled(Duration::from_secs(1)).await);
    assert_eq!(tokens_window(&mut c, ns), (anchor, 300));

    // Usage beyond the reservation is charged as it is reported, and the release (usage
    // equal to what was charged) changes nothing more.
    let mut permit = ledger
        .try_acquire(&LlmRequest::new(), reserve(200, 800))
        .await
        .unwrap();
    assert_eq!(tokens_window(&mut c, ns), (anchor, 1_300));
    permit
        .report_usage(TokenUsage::new(200, 1_300).unwrap())
        .await
        .unwrap();
    assert_eq!(tokens_window(&mut c, ns), (anchor, 1_800));
    permit.release(None);
    assert!(ledger.settled(Duration::from_secs(1)).await);
    assert_eq!(tokens_window(&mut c, ns), (anchor, 1_800));

    // A release with its final usage (and a drop after a report) corrects from the charge.
    let permit = ledger
        .try_acquire(&LlmRequest::new(), reserve(500, 500))
        .await
        .unwrap();
    assert_eq!(tokens_window(&mut c, ns), (anchor, 2_800));
    permit.release(Some(TokenUsage::new(400, 150).unwrap()));
    assert!(ledger.settled(Duration::from_secs(1)).await);
    assert_eq!(tokens_window(&mut c, ns), (anchor, 2_350));
    let mut permit = ledger
        .try_acquire(&LlmRequest::new(), reserve(500, 500))
        .await
        .unwrap();
    permit
        .report_usage(TokenUsage::new(500, 0).unwrap())
        .await
        .unwrap();
    drop(permit);
    assert!(ledger.settled(Duration::from_secs(1)).await);
    assert_eq!(tokens_window(&mut c, ns), (anchor, 2_850));
    // A permit dropped without any usage keeps its reservation charged.
    drop(
        ledger
            .try_acquire(&LlmRequest::new(), reserve(100, 100))
            .await
            .unwrap(),
    );
    assert!(ledger.settled(Duration::from_secs(1)).await);
    assert_eq!(tokens_window(&mut c, ns), (anchor, 3_050));

    // The status: what is left now (a tick drains every 36 ms, so a few ticks may have).
    let status = ledger.global_rate().await.unwrap().unwrap();
    let tokens = status.tokens.unwrap();
    assert_eq!(
        (status.window, tokens.limit),
        (Duration::from_secs(3_600), 100_000)
    );
    assert!((96_950..=100_000).contains(&tokens.remaining), "{tokens:?}");
    assert!(
        tokens.reset <= Duration::from_millis(3_050 * 36),
        "{tokens:?}"
    );
    assert_eq!(ledger.global().await.unwrap().in_flight_tokens, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_budget_refusal_charges_no_window_and_a_window_refusal_takes_no_hold() {
    let server = RedisServer::start();
    let ns = "{order}";
    // Two requests a day (a tick is 12 h: nothing drains during the test), 5,000 tokens.
    let rate = RateLimits::new(Duration::from_secs(86_400))
        .requests(2)
        .tokens(5_000);
    // A local budget larger than the global one, so that the global ledger decides.
    let ledger = ExactLedger::connect(bulkhead(10_000), config(&server, ns, "a", 1_000, rate))
        .await
        .unwrap();
    let mut c = server.connection().unwrap();
    let first = ledger
        .try_acquire(&LlmRequest::new(), reserve(300, 500))
        .await
        .unwrap();
    assert_eq!(requests_tat(&mut c, ns), Some(1));
    // The budget refuses the second: no window is charged.
    let refused = ledger
        .try_acquire(&LlmRequest::new(), reserve(100, 400))
        .await
        .unwrap_err();
    assert!(matches!(refused, LedgerRefusal::Global(_)), "{refused:?}");
    assert_eq!(requests_tat(&mut c, ns), Some(1));
    assert_eq!(tokens_window(&mut c, ns).1, 800);
    first.release(Some(TokenUsage::new(300, 500).unwrap()));
    assert!(ledger.settled(Duration::from_secs(1)).await);
    // So the next call fits the requests window: the second of its two.
    let second = ledger
        .try_acquire(&LlmRequest::new(), reserve(100, 400))
        .await
        .unwrap();
    assert_eq!(requests_tat(&mut c, ns), Some(2));
    // The third is refused by the requests window (judged first) and takes nothing.
    let before = observe(&mut c, ns);
    let started = Instant::now();
    let refused = ledger
        .try_acquire(&LlmRequest::new(), reserve(10, 10))
        .await
        .unwrap_err();
    let LedgerRefusal::GlobalRate(why) = &refused else {
        panic!("{refused:?}")
    };
    assert_eq!(why.window, RateWindow::Requests);
    // It fits at the start of tick 1, 12 h after the anchor (the first call).
    let retry = why.retry_after.unwrap();
    assert!(retry <= Duration::from_secs(43_200), "{retry:?}");
    assert!(
        retry >= Duration::from_secs(43_200) - started.elapsed() - Duration::from_secs(1),
        "{retry:?}"
    );
    assert_eq!(observe(&mut c, ns), before);
    assert_eq!((before.total, before.hold_count), (500, 1));
    assert_eq!(requests_tat(&mut c, ns), Some(2));
    second.release(None);
    assert!(ledger.settled(Duration::from_secs(1)).await);

    // A call larger than the tokens window can never fit: no retry-after, nothing taken.
    let big = replica(
        &server,
        "{never}",
        "b",
        100_000,
        RateLimits::per_minute().tokens(1_000),
    )
    .await;
    let refused = big
        .try_acquire(&LlmRequest::new(), reserve(600, 600))
        .await
        .unwrap_err();
    let LedgerRefusal::GlobalRate(why) = &refused else {
        panic!("{refused:?}")
    };
    assert_eq!(
        (why.window, why.requested, why.limit, why.retry_after),
        (RateWindow::Tokens, 1_200, 1_000, None)
    );
    assert_eq!(refused.retry_after(), None);
    assert_eq!(refused.reason(), Some(RejectReason::RateLimit));
    assert_eq!(big.global().await.unwrap().in_flight_tokens, 0);
    assert_eq!(big.bulkhead().stats().in_flight, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_validated_and_every_replica_must_agree() {
    let base = || LedgerConfig::new("redis://127.0.0.1:1/", "{v}", 1_000).replica_id("a");
    let cases = [
        (
            RateLimits::new(Duration::ZERO).requests(1),
            ConfigError::RateWindowOutOfRange {
                window: Duration::ZERO,
            },
        ),
        (
            RateLimits::new(Duration::from_secs(86_401)).requests(1),
            ConfigError::RateWindowOutOfRange {
                window: Duration::from_secs(86_401),
            },
        ),
        (RateLimits::per_minute(), ConfigError::RateLimitsEmpty),
        (
            RateLimits::per_minute().requests(0).tokens(10),
            ConfigError::RateLimitsEmpty,
        ),
        (
            RateLimits::per_minute().tokens(150_119_988),
            ConfigError::RateLimitTooHigh {
                limit: 150_119_988,
                window: Duration::from_secs(60),
                max: 150_119_987,
            },
        ),
    ];
    for (rate, error) in cases {
        let config = base().rate_limits(rate);
        assert_eq!(config.validate(), Err(error.clone()), "{rate:?}");
        // Refused before any connection (the URL has nothing listening).
        let connected = ExactLedger::connect(bulkhead(1_000), config).await;
        assert!(
            matches!(&connected, Err(LedgerError::Config(e)) if *e == error),
            "{:?}",
            connected.err()
        );
    }
    assert!(
        base()
            .rate_limits(RateLimits::per_minute().tokens(max_rate_limit(Duration::from_secs(60))))
            .validate()
            .is_ok()
    );

    let server = RedisServer::start();
    let ns = "{agree}";
    let rpm = RateLimits::per_minute().requests(500).tokens(200_000);
    let first = replica(&server, ns, "a", 10_000, rpm).await;
    let mut c = server.connection().unwrap();
    let stored = || -> Vec<(String, String)> {
        let mut c = server.connection().unwrap();
        redis::cmd("HGETALL")
            .arg(format!("{ns}:rate:limits"))
            .query(&mut c)
            .unwrap()
    };
    let before = stored();
    assert_eq!(
        before,
        [
            ("window_us".to_owned(), "60000000".to_owned()),
            ("requests".to_owned(), "500".to_owned()),
            ("tokens".to_owned(), "200000".to_owned()),
        ]
    );
    let other = RateLimits::per_minute().requests(600).tokens(200_000);
    for (theirs, id) in [(Some(other), "b"), (None, "c")] {
        let mut config = LedgerConfig::new(server.url(), ns, 10_000).replica_id(id);
        if let Some(rate) = theirs {
            config = config.rate_limits(rate);
        }
        let refused = ExactLedger::connect(bulkhead(10_000), config).await;
        match refused {
            Err(LedgerError::Config(ConfigError::RateLimitsMismatch { stored, configured })) => {
                assert_eq!((stored, configured), (Some(rpm), theirs));
            }
            other => panic!("{:?}", other.err()),
        }
    }
    // Nothing changed: the stored limits, the replicas.
    assert_eq!(stored(), before);
    assert_eq!(observe(&mut c, ns).replicas, 1);
    // The same limits join.
    let second = replica(&server, ns, "d", 10_000, rpm).await;
    assert_eq!(observe(&mut c, ns).replicas, 2);

    // Leased mode installs its share in the local windows: without them, refused before
    // touching Redis.
    let leased = LeasedLedger::start(
        bulkhead(10_000),
        LedgerConfig::new(server.url(), "{leased-rate}", 10_000).rate_limits(rpm),
    )
    .await;
    assert!(
        matches!(
            leased,
            Err(LedgerError::Config(ConfigError::LocalRateWindowsMissing))
        ),
        "{:?}",
        leased.err()
    );
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("{leased-rate}*")
        .query(&mut c)
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
    first.close().await.unwrap();
    second.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_losing_the_limits_stores_them_again_and_the_floor_bypasses_the_windows() {
    let mut server = RedisServer::start();
    let ns = "{outage}";
    let rate = RateLimits::new(Duration::from_secs(86_400)).requests(1);
    let config = config(&server, ns, "a", 10_000, rate)
        .timeout(Duration::from_millis(100))
        .retry_every(Duration::from_millis(50))
        .failure(FailurePolicy::LocalFloor { tokens: 60 });
    let ledger = opened(|| ExactLedger::connect(bulkhead(10_000), config.clone())).await;
    let one = ledger
        .try_acquire(&LlmRequest::new(), reserve(10, 10))
        .await
        .unwrap();
    assert!(one.is_global());
    assert!(matches!(
        ledger
            .try_acquire(&LlmRequest::new(), reserve(10, 10))
            .await,
        Err(LedgerRefusal::GlobalRate(_))
    ));
    // While Redis is down the windows cannot be charged: the floor admits what it holds (60
    // tokens in flight: three calls of 20), whatever the global window says.
    server.kill();
    let mut floor = Vec::new();
    let mut unavailable = 0;
    for _ in 0..4 {
        match ledger
            .try_acquire(&LlmRequest::new(), reserve(10, 10))
            .await
        {
            Ok(permit) => {
                assert!(!permit.is_global());
                floor.push(permit);
            }
            Err(LedgerRefusal::Unavailable(_)) => unavailable += 1,
            Err(other) => panic!("{other:?}"),
        }
    }
    assert_eq!((floor.len(), unavailable), (3, 1));
    // An empty Redis: the first reservation stores the limits again and starts a whole
    // window (its state was lost with the rest of the ledger).
    server.restart();
    let started = Instant::now();
    let permit = loop {
        tokio::time::sleep(Duration::from_millis(60)).await;
        match ledger
            .try_acquire(&LlmRequest::new(), reserve(10, 10))
            .await
        {
            Ok(permit) if permit.is_global() => break permit,
            _ => assert!(
                started.elapsed() < Duration::from_secs(10),
                "never recovered"
            ),
        }
    };
    let mut c = server.connection().unwrap();
    let window_us: Option<u64> = redis::cmd("HGET")
        .arg(format!("{ns}:rate:limits"))
        .arg("window_us")
        .query(&mut c)
        .unwrap();
    assert_eq!(window_us, Some(86_400_000_000));
    assert_eq!(requests_tat(&mut c, ns), Some(1));
    assert!(matches!(
        ledger
            .try_acquire(&LlmRequest::new(), reserve(10, 10))
            .await,
        Err(LedgerRefusal::GlobalRate(_))
    ));
    drop((one, floor, permit));
}
