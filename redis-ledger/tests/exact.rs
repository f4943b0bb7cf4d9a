//! Exact mode against a real redis-server: replicas (separate bulkheads) share one budget
//! exactly, global refusals carry the figures, usage moves the global hold, every token
//! returns, and a replica killed mid-stream (a separate process) has its holds expire.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_bulkhead_llm::rejection::Scope;
use async_bulkhead_llm::{LlmRequest, RejectReason, TokenUsage};
use async_bulkhead_llm_redis::{ExactLedger, LedgerConfig, LedgerRefusal};
use common::{Observer, RedisServer, bulkhead, observe, reserve};

async fn replica(server: &RedisServer, ns: &str, id: &str, global: u64, local: u64) -> ExactLedger {
    let config = LedgerConfig::new(server.url(), ns, global)
        .replica_id(id)
        .lease(Duration::from_secs(5));
    ExactLedger::connect(bulkhead(local), config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_global_refusal_carries_the_global_and_local_figures() {
    let server = RedisServer::start();
    let a = replica(&server, "{refusal}", "a", 1_000, 1_000).await;
    let b = replica(&server, "{refusal}", "b", 1_000, 1_000).await;
    let held = a
        .try_acquire(&LlmRequest::new(), reserve(100, 500))
        .await
        .unwrap();
    assert!(held.is_global());
    let refused = b
        .try_acquire(&LlmRequest::new(), reserve(100, 500))
        .await
        .unwrap_err();
    let LedgerRefusal::Global(global) = &refused else {
        panic!("a global refusal, got {refused:?}")
    };
    assert_eq!(
        (
            global.requested,
            global.global_in_flight,
            global.global_budget
        ),
        (600, 600, 1_000)
    );
    // The local admission was returned: b's bulkhead holds nothing.
    let local = global.local.unwrap();
    assert_eq!((local.in_flight_tokens, local.budget), (0, 1_000));
    assert_eq!(b.bulkhead().stats().in_flight, 0);
    assert_eq!(refused.reason(), Some(RejectReason::BudgetLimit));
    assert_eq!(refused.http_status(), 429);
    assert_eq!(b.stats().refused_global, 1);
    // It is the core crate's refusal too, scoped `global`, answered as a local one.
    let rejection = refused.rejection().unwrap();
    assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
    assert_eq!(rejection.scope(), Some(Scope::Global));
    let tokens = rejection.detail().token_budget.unwrap();
    assert_eq!(
        (
            tokens.budget,
            tokens.in_flight_tokens,
            tokens.available,
            tokens.requested
        ),
        (1_000, 600, 400, 600)
    );
    assert_eq!(
        (
            rejection.detail().in_flight,
            rejection.detail().max_concurrent
        ),
        (0, 64)
    );
    let answer = refused.http_refusal().unwrap();
    assert_eq!(
        (answer.status, answer.code, answer.scope),
        (429, "budget_limit", Some(Scope::Global))
    );
    assert!(
        answer.message.contains("global bulkhead rejected"),
        "{}",
        answer.message
    );
    // A local refusal stays local, and changes nothing in Redis.
    let too_big = a
        .try_acquire(&LlmRequest::new(), reserve(100, 900))
        .await
        .unwrap_err();
    assert!(matches!(too_big, LedgerRefusal::Local(_)), "{too_big:?}");
    let answer = too_big.http_refusal().unwrap();
    assert_eq!((answer.status, answer.scope), (429, None)); // as the core crate answers it
    let mut c = server.connection().unwrap();
    assert_eq!(observe(&mut c, "{refusal}").total, 600);
    held.release(None);
    assert!(a.settled(Duration::from_secs(2)).await);
    let seen = observe(&mut c, "{refusal}");
    assert_eq!((seen.total, seen.hold_count), (0, 0));
    assert!(
        b.try_acquire(&LlmRequest::new(), reserve(100, 500))
            .await
            .is_ok()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_moves_the_global_hold_and_release_settles_it() {
    let server = RedisServer::start();
    let ledger = replica(&server, "{usage}", "a", 10_000, 10_000).await;
    let mut c = server.connection().unwrap();
    let mut permit = ledger
        .try_acquire(&LlmRequest::new(), reserve(100, 1_000))
        .await
        .unwrap();
    assert_eq!(observe(&mut c, "{usage}").total, 1_100);
    // The prompt was 20 tokens: 80 go back, globally too.
    let report = permit
        .report_usage(TokenUsage::new(20, 5).unwrap())
        .await
        .unwrap();
    assert_eq!((report.held, report.sequence), (1_020, 1));
    assert_eq!(observe(&mut c, "{usage}").total, 1_020);
    // Output past the reservation: the global hold grows with it.
    permit
        .report_usage(TokenUsage::new(20, 1_400).unwrap())
        .await
        .unwrap();
    assert_eq!(observe(&mut c, "{usage}").total, 1_420);
    // A stale report changes nothing, locally or globally.
    let stale = permit
        .report_usage(TokenUsage::new(10, 10).unwrap())
        .await
        .unwrap();
    assert_eq!(stale.sequence, 2);
    assert_eq!(observe(&mut c, "{usage}").total, 1_420);
    assert_eq!(ledger.stats().usage_applied, 2);
    permit.release(None);
    assert!(ledger.settled(Duration::from_secs(2)).await);
    assert_eq!(observe(&mut c, "{usage}").total, 0);
    assert_eq!(
        ledger
            .bulkhead()
            .stats()
            .token_budget
            .unwrap()
            .in_flight_tokens,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_permit_is_released_globally_by_the_background_task() {
    let server = RedisServer::start();
    let ledger = replica(&server, "{dropped}", "a", 10_000, 10_000).await;
    let mut c = server.connection().unwrap();
    let permit = ledger
        .try_acquire(&LlmRequest::new(), reserve(100, 400))
        .await
        .unwrap();
    assert_eq!(observe(&mut c, "{dropped}").total, 500);
    drop(permit);
    assert_eq!(
        ledger.bulkhead().stats().in_flight,
        0,
        "released locally at once"
    );
    let mut waited = 0;
    while observe(&mut c, "{dropped}").total != 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
        assert!(waited < 200, "the deferred release never reached Redis");
    }
    assert_eq!(ledger.stats().releases_deferred, 1);
    assert_eq!(ledger.stats().releases_pending, 0);
}

/// Three replicas, four tasks each, hammer one ledger with random reservations, usage
/// reports (refunds only, so holds never pass what was admitted), releases and drops; an
/// observer reads the total from Redis every half millisecond. The budget bites (some calls
/// are refused globally), is never exceeded, and every token returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_share_one_budget_exactly_and_every_token_returns() {
    let server = RedisServer::start();
    let ns = "{hammer}";
    let budget = 12_000;
    let observer = Observer::start(&server, ns, budget);
    let mut ledgers = Vec::new();
    for r in 0..3 {
        ledgers.push(replica(&server, ns, &format!("r{r}"), budget, 8_000).await);
    }
    let admitted = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (r, ledger) in ledgers.iter().enumerate() {
        for t in 0..4u64 {
            let ledger = ledger.clone();
            let admitted = admitted.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = fastrand_seed(r as u64 * 31 + t);
                for i in 0..150u64 {
                    let input = 50 + rng() % 500;
                    let output = 100 + rng() % 1_500;
                    let Ok(mut permit) = ledger
                        .try_acquire(&LlmRequest::new(), reserve(input, output))
                        .await
                    else {
                        continue;
                    };
                    admitted.fetch_add(1, Ordering::Relaxed);
                    if i % 3 != 0 {
                        let usage = TokenUsage::new(input / 2, output / 3).unwrap();
                        permit.report_usage(usage).await.unwrap();
                    }
                    tokio::time::sleep(Duration::from_micros(rng() % 1_500)).await;
                    if i % 5 == 0 {
                        drop(permit);
                    } else {
                        permit.release(None);
                    }
                }
            }));
        }
    }
    for task in tasks {
        task.await.unwrap();
    }
    // Deferred releases (dropped permits) reach Redis from the background tasks.
    let mut c = server.connection().unwrap();
    let mut waited = 0;
    while observe(&mut c, ns).total != 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        waited += 1;
        assert!(
            waited < 300,
            "tokens never returned: {:?}",
            observe(&mut c, ns)
        );
    }
    let (reads, peak) = observer.finish();
    let seen = observe(&mut c, ns);
    assert_eq!(
        (seen.total, seen.holds, seen.hold_count, seen.replicas),
        (0, 0, 0, 3)
    );
    let refused: u64 = ledgers.iter().map(|l| l.stats().refused_global).sum();
    let reserved: u64 = ledgers.iter().map(|l| l.stats().reserved).sum();
    assert_eq!(reserved, admitted.load(Ordering::Relaxed));
    assert!(refused > 0, "the global budget never bit (peak {peak})");
    assert!(
        reads > 10 && peak > budget / 2,
        "{reads} reads, peak {peak}"
    );
    for ledger in &ledgers {
        let local = ledger.bulkhead().stats();
        assert_eq!(
            (
                local.in_flight,
                local.token_budget.unwrap().in_flight_tokens
            ),
            (0, 0)
        );
        assert_eq!(ledger.stats().store_errors, 0);
    }
}

/// A small xorshift generator per task (deterministic per seed).
fn fastrand_seed(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// The child side of the crash test: a replica that reserves three calls, says so, and
/// waits to be killed. Does nothing unless the parent set `LEDGER_CHILD`.
#[test]
fn crash_child() {
    let Ok(spec) = std::env::var("LEDGER_CHILD") else {
        return;
    };
    let (url, ns) = spec.split_once(' ').unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let config = LedgerConfig::new(url, ns, 10_000)
            .replica_id("doomed")
            .lease(Duration::from_millis(600));
        let ledger = ExactLedger::connect(bulkhead(10_000), config)
            .await
            .unwrap();
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(
                ledger
                    .try_acquire(&LlmRequest::new(), reserve(100, 900))
                    .await
                    .unwrap(),
            );
        }
        println!("LEDGER_CHILD_HELD");
        tokio::time::sleep(Duration::from_secs(600)).await;
    });
}

/// A replica process killed (SIGKILL) with three calls held: the others see its tokens held
/// until its lease lapses, then returned, with no operator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replica_has_its_holds_expire() {
    use std::io::{BufRead, BufReader};
    let server = RedisServer::start();
    let ns = "{crash}";
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("LEDGER_CHILD", format!("{} {ns}", server.url()))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let held = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .any(|line| line.is_ok_and(|l| l.contains("LEDGER_CHILD_HELD")))
    });
    assert!(held.join().unwrap(), "the child never held its calls");
    let mut c = server.connection().unwrap();
    assert_eq!(observe(&mut c, ns).total, 3_000);
    let survivor = replica(&server, ns, "survivor", 10_000, 10_000).await;
    // Full: the survivor is refused while the child's holds are live.
    let refused = survivor
        .try_acquire(&LlmRequest::new(), reserve(1_000, 7_001))
        .await
        .unwrap_err();
    assert!(matches!(refused, LedgerRefusal::Global(g) if g.global_in_flight == 3_000));
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = std::time::Instant::now();
    // Within the lease (600 ms) plus a margin, the holds are purged by the survivor's calls.
    loop {
        match survivor
            .try_acquire(&LlmRequest::new(), reserve(1_000, 7_001))
            .await
        {
            Ok(permit) => {
                permit.release(None);
                assert!(survivor.settled(Duration::from_secs(2)).await);
                break;
            }
            Err(LedgerRefusal::Global(_)) => {
                assert!(
                    killed.elapsed() < Duration::from_secs(3),
                    "the holds never expired"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(other) => panic!("{other:?}"),
        }
    }
    let seen = observe(&mut c, ns);
    assert_eq!((seen.total, seen.hold_count, seen.replicas), (0, 0, 1));
}

/// The child side of the multi-process test: a replica that makes 300 calls with random
/// reservations, usage reports and hold times, waits for its releases to reach Redis, and
/// prints what it did. Does nothing unless the parent set `LEDGER_HAMMER`.
#[test]
fn hammer_child() {
    let Ok(spec) = std::env::var("LEDGER_HAMMER") else {
        return;
    };
    let mut parts = spec.split(' ');
    let (url, ns, id) = (
        parts.next().unwrap(),
        parts.next().unwrap(),
        parts.next().unwrap(),
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let config = LedgerConfig::new(url, ns, 8_000)
            .replica_id(id)
            .lease(Duration::from_secs(5));
        let ledger = ExactLedger::connect(bulkhead(6_000), config).await.unwrap();
        let tasks: Vec<_> = (0..3u64)
            .map(|t| {
                let ledger = ledger.clone();
                let seed = id.bytes().map(u64::from).sum::<u64>() * 7 + t;
                tokio::spawn(async move {
                    let mut rng = fastrand_seed(seed);
                    for i in 0..100u64 {
                        let (input, output) = (50 + rng() % 400, 100 + rng() % 1_200);
                        let Ok(mut permit) = ledger
                            .try_acquire(&LlmRequest::new(), reserve(input, output))
                            .await
                        else {
                            continue;
                        };
                        if i % 2 == 0 {
                            let usage = TokenUsage::new(input / 2, output / 2).unwrap();
                            permit.report_usage(usage).await.unwrap();
                        }
                        tokio::time::sleep(Duration::from_micros(rng() % 2_000)).await;
                        permit.release(None);
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap();
        }
        assert!(ledger.settled(Duration::from_secs(5)).await);
        let stats = ledger.stats();
        println!(
            "LEDGER_HAMMER_DONE reserved={} refused_global={} errors={}",
            stats.reserved, stats.refused_global, stats.store_errors
        );
        ledger.close().await.unwrap();
    });
}

/// Three replica processes and one in this process hammer one ledger at once while the
/// observer reads Redis: the global budget bites, is never exceeded, and every token returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_hammer_one_ledger() {
    let server = RedisServer::start();
    let ns = "{processes}";
    let observer = Observer::start(&server, ns, 8_000);
    let children: Vec<_> = (0..3)
        .map(|p| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "hammer_child",
                    "--nocapture",
                    "--test-threads",
                    "1",
                ])
                .env(
                    "LEDGER_HAMMER",
                    format!("{} {ns} process-{p}", server.url()),
                )
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let local = replica(&server, ns, "parent", 8_000, 6_000).await;
    let mut rng = fastrand_seed(99);
    let mut parent_reserved = 0;
    for _ in 0..150 {
        if let Ok(permit) = local
            .try_acquire(
                &LlmRequest::new(),
                reserve(50 + rng() % 400, 100 + rng() % 1_200),
            )
            .await
        {
            parent_reserved += 1;
            tokio::time::sleep(Duration::from_micros(rng() % 2_000)).await;
            permit.release(None);
        }
    }
    let (mut reserved, mut refused) = (parent_reserved, local.stats().refused_global);
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "a replica process failed");
        let text = String::from_utf8_lossy(&output.stdout);
        let line = text
            .lines()
            .find(|l| l.contains("LEDGER_HAMMER_DONE"))
            .expect("the child reports");
        let field = |name: &str| -> u64 {
            let start = line.find(name).unwrap() + name.len() + 1;
            line[start..].split(' ').next().unwrap().parse().unwrap()
        };
        assert_eq!(field("errors"), 0);
        reserved += field("reserved");
        refused += field("refused_global");
    }
    assert!(local.settled(Duration::from_secs(5)).await);
    let (reads, peak) = observer.finish();
    let mut c = server.connection().unwrap();
    let seen = observe(&mut c, ns);
    assert_eq!(
        (seen.total, seen.holds, seen.hold_count),
        (0, 0, 0),
        "{seen:?}"
    );
    assert!(
        reserved > 100 && refused > 0,
        "{reserved} reserved, {refused} refused"
    );
    assert!(reads > 10 && peak > 4_000, "{reads} reads, peak {peak}");
}
