//! Leased mode against a real redis-server: slices start at the whole budget for a lone
//! replica, move toward fair shares as others join, shrink only as far as the tokens still in
//! flight, never sum above the global budget (checked by an observer reading Redis), and are
//! given back on close.

mod common;

use std::time::Duration;

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
use async_bulkhead_llm_redis::{LeasedLedger, LedgerConfig};
use common::{Observer, RedisServer, observe};

fn bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("m", 256)
        .token_budget(TokenBudget::new(1_000_000))
        .build()
        .unwrap()
}

fn reserve(tokens: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(tokens / 2, tokens - tokens / 2).unwrap())
}

/// A replica whose background rebalance stays out of the way (the test rebalances by hand).
async fn replica(server: &RedisServer, ns: &str, id: &str, local: &LlmBulkhead) -> LeasedLedger {
    let config = LedgerConfig::new(server.url(), ns, 10_000)
        .replica_id(id)
        .lease(Duration::from_secs(90))
        .renew_every(Duration::from_secs(30));
    LeasedLedger::start(local.clone(), config).await.unwrap()
}

fn budget(b: &LlmBulkhead) -> u64 {
    b.limits().token_budget.unwrap().budget
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_follow_use_and_shrink_no_further_than_what_is_in_flight() {
    let server = RedisServer::start();
    let ns = "{slices}";
    let mut c = server.connection().unwrap();
    let (local_a, local_b) = (bulkhead(), bulkhead());
    let a = replica(&server, ns, "a", &local_a).await;
    // Alone, a asks for everything and gets it, installed as its local budget.
    assert_eq!((a.slice(), budget(&local_a)), (10_000, 10_000));
    let held = local_a
        .try_acquire_owned(&LlmRequest::new(), reserve(6_000))
        .unwrap();
    // b joins: no room until a gives some back.
    let b = replica(&server, ns, "b", &local_b).await;
    assert_eq!((b.slice(), budget(&local_b)), (0, 0));
    assert!(local_b.try_acquire(&LlmRequest::new(), reserve(1)).is_err());
    // a uses 6,000 (it asks for 7,500); both want more than the fair 5,000, so a's target is
    // 5,000: its local budget drops to 5,000 at once, its slice only to the 6,000 in flight.
    assert_eq!(a.rebalance().await.unwrap(), 6_000);
    assert_eq!(budget(&local_a), 5_000);
    assert_eq!(b.rebalance().await.unwrap(), 4_000);
    assert_eq!(budget(&local_b), 4_000);
    let seen = observe(&mut c, ns);
    assert_eq!((seen.total, seen.slices), (10_000, 10_000));
    // b uses 3,000 and is refused more (it asks for twice its slice, 8,000); a finishes and
    // goes idle (it asks for one token): a keeps one, b gets the rest.
    let busy = local_b
        .try_acquire_owned(&LlmRequest::new(), reserve(3_000))
        .unwrap();
    assert!(
        local_b
            .try_acquire(&LlmRequest::new(), reserve(2_000))
            .is_err()
    );
    drop(held);
    assert_eq!(a.rebalance().await.unwrap(), 1);
    assert_eq!(b.rebalance().await.unwrap(), 9_999);
    assert_eq!(budget(&local_b), 9_999);
    drop(busy);
    // Closing gives the slice back and stops local admission.
    assert_eq!(a.close().await.unwrap(), 1);
    assert_eq!(budget(&local_a), 0);
    let seen = observe(&mut c, ns);
    assert_eq!((seen.total, seen.slices, seen.replicas), (9_999, 9_999, 1));
}

/// Three replicas admit locally as fast as they can while their background tasks rebalance
/// every 50 ms; an observer reads the total from Redis every half millisecond. The sum of the
/// slices never exceeds the budget, and no replica ever holds more in flight than its slice
/// allows once it has shrunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_slices_never_sum_above_the_global_budget() {
    let server = RedisServer::start();
    let ns = "{live}";
    let observer = Observer::start(&server, ns, 10_000);
    let mut replicas = Vec::new();
    for r in 0..3 {
        let local = bulkhead();
        let config = LedgerConfig::new(server.url(), ns, 10_000)
            .replica_id(format!("r{r}"))
            .lease(Duration::from_millis(600))
            .renew_every(Duration::from_millis(50));
        let ledger = LeasedLedger::start(local.clone(), config).await.unwrap();
        replicas.push((local, ledger));
    }
    let mut tasks = Vec::new();
    for (r, (local, _)) in replicas.iter().enumerate() {
        for t in 0..2u64 {
            let local = local.clone();
            tasks.push(tokio::spawn(async move {
                let mut admitted = 0u64;
                let deadline = std::time::Instant::now() + Duration::from_millis(1_500);
                let mut i = r as u64 * 7 + t;
                while std::time::Instant::now() < deadline {
                    i = i
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let tokens = 100 + (i >> 33) % 900;
                    if let Ok(permit) = local.try_acquire_owned(&LlmRequest::new(), reserve(tokens))
                    {
                        admitted += 1;
                        tokio::time::sleep(Duration::from_micros((i >> 20) % 2_000)).await;
                        drop(permit);
                    } else {
                        tokio::time::sleep(Duration::from_micros(200)).await;
                    }
                }
                admitted
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.unwrap();
    }
    let (reads, peak) = observer.finish();
    assert!(
        admitted > 100 && reads > 100,
        "{admitted} admitted, {reads} reads"
    );
    assert!(peak > 5_000, "the slices never grew: peak {peak}");
    let mut c = server.connection().unwrap();
    let seen = observe(&mut c, ns);
    let slices: u64 = replicas.iter().map(|(_, l)| l.slice()).sum();
    assert!(
        seen.total <= 10_000 && seen.slices == seen.total,
        "{seen:?}"
    );
    assert!(slices <= 10_000, "{slices}");
    for (local, ledger) in &replicas {
        assert_eq!(local.stats().in_flight, 0);
        assert!(ledger.stats().rebalances >= 5, "{:?}", ledger.stats());
        ledger.close().await.unwrap();
    }
    assert_eq!(observe(&mut c, ns).total, 0);
}

/// Global rate windows in leased mode: each replica's local windows are its share of the
/// global limits, in proportion to its slice, installed with it. Two replicas on halves of the
/// budget each let exactly half of a 60-a-minute window through at once (their windows frozen
/// on a manual clock), 60 between them; a slice given back takes its share with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_windows_are_shared_in_proportion_to_the_slices() {
    use async_bulkhead_llm::RejectReason;
    use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};
    let server = RedisServer::start();
    let ns = "{leased-windows}";
    let clock = ManualClock::new();
    let windowed = |cap: u64| {
        LlmBulkhead::builder("m", 256)
            .token_budget(TokenBudget::new(cap))
            .rate_limits(RateLimits::per_minute().requests(1))
            .rate_clock(RateClock::manual(&clock))
            .build()
            .unwrap()
    };
    let global = RateLimits::per_minute().requests(60).tokens(100_000);
    let config = |id: &str| {
        LedgerConfig::new(server.url(), ns, 10_000)
            .replica_id(id)
            .lease(Duration::from_secs(90))
            .renew_every(Duration::from_secs(30))
            .rate_limits(global)
    };
    // Each asks for at most half of the budget.
    let (a_local, b_local) = (windowed(5_000), windowed(5_000));
    let a = LeasedLedger::start(a_local.clone(), config("a"))
        .await
        .unwrap();
    let b = LeasedLedger::start(b_local.clone(), config("b"))
        .await
        .unwrap();
    assert_eq!((a.slice(), b.slice()), (5_000, 5_000));
    for local in [&a_local, &b_local] {
        let rate = local.limits().rate.unwrap();
        assert_eq!((rate.requests, rate.tokens), (Some(30), Some(50_000)));
    }
    // Exactly 30 calls each, then the local window refuses (`rate_limit`).
    for local in [&a_local, &b_local] {
        for _ in 0..30 {
            drop(local.try_acquire(&LlmRequest::new(), reserve(10)).unwrap());
        }
        let refused = local
            .try_acquire(&LlmRequest::new(), reserve(10))
            .unwrap_err();
        assert_eq!(
            refused.rejection().unwrap().reason(),
            RejectReason::RateLimit
        );
    }
    // Closing gives the slice back, and the share with it.
    a.close().await.unwrap();
    assert_eq!(a_local.limits().rate.unwrap().requests, Some(1));
    b.close().await.unwrap();
}

/// A leased replica with global rate limits needs local windows to install its share in: a
/// bulkhead without them is refused before anything is written.
#[tokio::test]
async fn global_windows_need_local_windows() {
    use async_bulkhead_llm::rate::RateLimits;
    use async_bulkhead_llm_redis::{ConfigError, LedgerError};
    let server = RedisServer::start();
    let config = LedgerConfig::new(server.url(), "{no-windows}", 10_000)
        .rate_limits(RateLimits::per_minute().requests(60));
    let refused = LeasedLedger::start(bulkhead(), config).await;
    assert!(
        matches!(
            refused,
            Err(LedgerError::Config(ConfigError::LocalRateWindowsMissing))
        ),
        "{:?}",
        refused.err()
    );
    let mut c = server.connection().unwrap();
    assert_eq!(observe(&mut c, "{no-windows}").replicas, 0);
}

/// The bound when shares move, as the crate docs state it: a shrinking replica keeps the units
/// it charged (up to its new limit), and the growing one's new room is there at once, so one
/// window can see up to the share moved more than the limit. Here, on a frozen clock: a,
/// alone, holds the whole budget and lets the whole 60-a-minute window through; its slice
/// then shrinks to 1 token and b's grows to half, whose share (30) is there at once: 90 in
/// one window, the limit plus the share moved, and not one more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_sees_at_most_the_share_moved_more_than_its_limit() {
    use async_bulkhead_llm::RejectReason;
    use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};
    let server = RedisServer::start();
    let ns = "{leased-moves}";
    let clock = ManualClock::new();
    let windowed = || {
        LlmBulkhead::builder("m", 256)
            .token_budget(TokenBudget::new(10_000))
            .rate_limits(RateLimits::per_minute().requests(1))
            .rate_clock(RateClock::manual(&clock))
            .build()
            .unwrap()
    };
    let config = |id: &str| {
        LedgerConfig::new(server.url(), ns, 10_000)
            .replica_id(id)
            .lease(Duration::from_secs(90))
            .renew_every(Duration::from_secs(30))
            .rate_limits(RateLimits::per_minute().requests(60))
    };
    let admit_all = |local: &LlmBulkhead| {
        let mut admitted = 0;
        loop {
            match local.try_acquire(&LlmRequest::new(), reserve(10)) {
                Ok(permit) => {
                    drop(permit);
                    admitted += 1;
                }
                Err(refused) => return (admitted, refused.rejection().unwrap().reason()),
            }
        }
    };
    let (a_local, b_local) = (windowed(), windowed());
    let a = LeasedLedger::start(a_local.clone(), config("a"))
        .await
        .unwrap();
    assert_eq!(a.slice(), 10_000);
    assert_eq!(admit_all(&a_local), (60, RejectReason::RateLimit));
    // b joins with nothing free, and is refused for want of tokens (so it asks for its share).
    let b = LeasedLedger::start(b_local.clone(), config("b"))
        .await
        .unwrap();
    assert_eq!(b.slice(), 0);
    assert_eq!(admit_all(&b_local).0, 0);
    // a, idle, shrinks to 1 token (a share of 1); b grows to its fair half (a share of 30).
    assert_eq!(a.rebalance().await.unwrap(), 1);
    assert_eq!(b.rebalance().await.unwrap(), 5_000);
    assert_eq!(b_local.limits().rate.unwrap().requests, Some(30));
    assert_eq!(admit_all(&b_local), (30, RejectReason::RateLimit));
    assert_eq!(admit_all(&a_local).1, RejectReason::RateLimit);
    // 60 + 30 in one window: the limit plus the share moved, as stated.
    a.close().await.unwrap();
    b.close().await.unwrap();
}
