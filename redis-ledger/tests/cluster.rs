//! The ledger on a real Redis Cluster (three masters, three replicas, on loopback): exact mode
//! with two replicas sharing one budget, every key of a namespace on one slot, leased mode,
//! rate windows, the failover of the namespace's master (graceful, and a kill that loses the
//! master's last writes), a resharding that moves the namespace's slot, and the ledger's
//! timeout against a frozen master and a frozen cluster.

mod common;

use std::time::{Duration, Instant};

use async_bulkhead_llm::LlmRequest;
use async_bulkhead_llm::rate::{RateLimits, RateWindow};
use async_bulkhead_llm_redis::{
    ExactLedger, GlobalSnapshot, LeasedLedger, LedgerConfig, LedgerRefusal,
};
use common::{RedisCluster, bulkhead, observe, reserve};

fn config(cluster: &RedisCluster, ns: &str, id: &str) -> LedgerConfig {
    LedgerConfig::cluster(cluster.urls(), ns, 10_000)
        .replica_id(id)
        .lease(Duration::from_secs(6))
        .renew_every(Duration::from_secs(2))
        .timeout(Duration::from_millis(300))
        .retry_every(Duration::from_millis(50))
}

async fn replica(cluster: &RedisCluster, ns: &str, id: &str) -> ExactLedger {
    ExactLedger::connect(bulkhead(10_000), config(cluster, ns, id))
        .await
        .unwrap()
}

fn snapshot(in_flight_tokens: u64, replicas: u64) -> GlobalSnapshot {
    GlobalSnapshot {
        in_flight_tokens,
        replicas,
        leased_replicas: 0,
    }
}

/// Every key of the cluster, per master: `(master port, keys)`.
fn keys_by_master(cluster: &RedisCluster) -> Vec<(u16, Vec<String>)> {
    cluster
        .masters()
        .into_iter()
        .map(|port| {
            let mut keys: Vec<String> = redis::cmd("KEYS")
                .arg("*")
                .query(&mut cluster.connection(port))
                .unwrap();
            keys.sort();
            (port, keys)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_share_one_budget_on_one_slot() {
    let cluster = RedisCluster::start(3);
    let ns = "{exact}";
    let slot = cluster.slot(ns);
    let a = replica(&cluster, ns, "a").await;
    let b = replica(&cluster, ns, "b").await;

    let a1 = a
        .try_acquire(&LlmRequest::new(), reserve(1_000, 3_000))
        .await
        .unwrap();
    let b1 = b
        .try_acquire(&LlmRequest::new(), reserve(2_000, 2_000))
        .await
        .unwrap();
    assert!(a1.is_global() && b1.is_global());
    assert_eq!(a.global().await.unwrap(), snapshot(8_000, 2));
    // 8,000 + 2,000 would be exactly the budget; 8,000 + 2,001 is not.
    let refused = a
        .try_acquire(&LlmRequest::new(), reserve(1, 2_000))
        .await
        .unwrap_err();
    let LedgerRefusal::Global(why) = &refused else {
        panic!("a global refusal, got {refused:?}")
    };
    assert_eq!(
        (why.requested, why.global_in_flight, why.global_budget),
        (2_001, 8_000, 10_000)
    );
    assert_eq!(
        a.bulkhead().stats().in_flight,
        1,
        "the local admission was returned"
    );
    let b2 = b
        .try_acquire(&LlmRequest::new(), reserve(500, 1_500))
        .await
        .unwrap();
    assert_eq!(b.global().await.unwrap(), snapshot(10_000, 2));

    // Every key of the namespace is on the master serving the namespace's slot, in that slot;
    // no other master holds any key.
    let master = cluster.master_of(slot, cluster.masters()[0]).unwrap();
    let by_master = keys_by_master(&cluster);
    assert_eq!(by_master.len(), 3);
    for (port, keys) in &by_master {
        if *port != master {
            assert!(keys.is_empty(), "master {port} holds {keys:?}");
            continue;
        }
        for key in [":total", ":leases", ":holds:a", ":holds:b"] {
            assert!(keys.contains(&format!("{ns}{key}")), "{keys:?}");
        }
        for key in keys {
            assert!(key.starts_with(ns), "{key}");
            assert_eq!(cluster.slot(key), slot, "{key}");
        }
        let in_slot: usize = redis::cmd("CLUSTER")
            .arg("COUNTKEYSINSLOT")
            .arg(slot)
            .query(&mut cluster.connection(master))
            .unwrap();
        assert_eq!(in_slot, keys.len());
    }
    let seen = observe(&mut cluster.connection(master), ns);
    assert_eq!(
        (seen.total, seen.holds, seen.hold_count, seen.replicas),
        (10_000, 10_000, 3, 2)
    );

    // Release gives the tokens back: what was refused now fits.
    a1.release(None);
    assert!(a.settled(Duration::from_secs(2)).await);
    assert_eq!(a.global().await.unwrap(), snapshot(6_000, 2));
    let a2 = a
        .try_acquire(&LlmRequest::new(), reserve(1, 2_000))
        .await
        .unwrap();
    assert_eq!(b.global().await.unwrap(), snapshot(8_001, 2));
    // A PING goes to the namespace's master (and answers).
    a.ping().await.unwrap();
    for permit in [a2, b1, b2] {
        permit.release(None);
    }
    assert!(a.settled(Duration::from_secs(2)).await && b.settled(Duration::from_secs(2)).await);
    assert_eq!(a.global().await.unwrap(), snapshot(0, 2));
    assert_eq!((a.close().await.unwrap(), b.close().await.unwrap()), (0, 0));
    assert_eq!(a.global().await.unwrap(), snapshot(0, 0));
    let stats = a.stats();
    assert_eq!((stats.store_errors, stats.refused_global), (0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_mode_leases_and_installs_a_slice() {
    let cluster = RedisCluster::start(3);
    let ns = "{leased}";
    let local_a = common::bulkhead(1_000_000);
    let local_b = common::bulkhead(1_000_000);
    let config = |id: &str| {
        config(&cluster, ns, id)
            .lease(Duration::from_secs(90))
            .renew_every(Duration::from_secs(30))
    };
    let a = LeasedLedger::start(local_a.clone(), config("a"))
        .await
        .unwrap();
    // Alone, a leases the whole budget and installs it as its local budget.
    assert_eq!(a.slice(), 10_000);
    assert_eq!(local_a.limits().token_budget.unwrap().budget, 10_000);
    let held = local_a
        .try_acquire_owned(&LlmRequest::new(), reserve(3_000, 3_000))
        .unwrap();
    let b = LeasedLedger::start(local_b.clone(), config("b"))
        .await
        .unwrap();
    assert_eq!(b.slice(), 0);
    // b is refused locally (no room until a gives some back): it wants more.
    assert!(
        local_b
            .try_acquire(&LlmRequest::new(), reserve(0, 1))
            .is_err()
    );
    // a uses 6,000 and both want more than the fair 5,000: a keeps what is in flight.
    assert_eq!(a.rebalance().await.unwrap(), 6_000);
    assert_eq!(local_a.limits().token_budget.unwrap().budget, 5_000);
    assert_eq!(b.rebalance().await.unwrap(), 4_000);
    assert_eq!(local_b.limits().token_budget.unwrap().budget, 4_000);
    let global = b.global().await.unwrap();
    assert_eq!(
        (
            global.in_flight_tokens,
            global.replicas,
            global.leased_replicas
        ),
        (10_000, 2, 2)
    );
    let master = cluster
        .master_of(cluster.slot(ns), cluster.masters()[0])
        .unwrap();
    let seen = observe(&mut cluster.connection(master), ns);
    assert_eq!(
        (seen.total, seen.slices, seen.replicas),
        (10_000, 10_000, 2)
    );
    drop(held);
    assert_eq!(a.close().await.unwrap(), 6_000);
    assert_eq!(b.close().await.unwrap(), 4_000);
    assert_eq!(observe(&mut cluster.connection(master), ns).total, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_windows_are_shared_on_the_cluster() {
    let cluster = RedisCluster::start(3);
    let ns = "{rated}";
    // Three requests a minute: no refill within the test.
    let rate = RateLimits::per_minute().requests(3);
    let a = ExactLedger::connect(
        bulkhead(10_000),
        config(&cluster, ns, "a").rate_limits(rate),
    )
    .await
    .unwrap();
    let b = ExactLedger::connect(
        bulkhead(10_000),
        config(&cluster, ns, "b").rate_limits(rate),
    )
    .await
    .unwrap();
    let mut held = Vec::new();
    for ledger in [&a, &b, &a] {
        held.push(
            ledger
                .try_acquire(&LlmRequest::new(), reserve(10, 10))
                .await
                .unwrap(),
        );
    }
    let refused = b
        .try_acquire(&LlmRequest::new(), reserve(10, 10))
        .await
        .unwrap_err();
    let LedgerRefusal::GlobalRate(why) = &refused else {
        panic!("a global rate refusal, got {refused:?}")
    };
    assert_eq!(
        (why.window, why.requested, why.limit, why.period),
        (RateWindow::Requests, 1, 3, Duration::from_secs(60))
    );
    // The first fits again 20 s (a minute over three) after the first call, less the
    // moments since.
    let retry = why.retry_after.unwrap();
    assert!(
        retry <= Duration::from_secs(20) && retry > Duration::from_secs(19),
        "{retry:?}"
    );
    let status = a.global_rate().await.unwrap().unwrap();
    let requests = status.requests.unwrap();
    assert_eq!((requests.limit, requests.remaining), (3, 0));
    assert_eq!(a.global().await.unwrap(), snapshot(60, 2));
    let master = cluster
        .master_of(cluster.slot(ns), cluster.masters()[0])
        .unwrap();
    // The limits are stored on the namespace's master, beside the windows.
    let limits: Vec<u64> = redis::cmd("HMGET")
        .arg(format!("{ns}:rate:limits"))
        .arg("window_us")
        .arg("requests")
        .arg("tokens")
        .query(&mut cluster.connection(master))
        .unwrap();
    assert_eq!(limits, [60_000_000, 3, 0]);
    assert_eq!(cluster.slot(&format!("{ns}:rate")), cluster.slot(ns));
    drop(held);
    assert!(a.settled(Duration::from_secs(2)).await && b.settled(Duration::from_secs(2)).await);
    assert_eq!(a.global().await.unwrap(), snapshot(0, 2));
}

/// Probes `ledger` every 20 ms with a call of 100 tokens (released at once) until one is
/// admitted globally; the time since `since`.
async fn until_admitted(ledger: &ExactLedger, since: Instant, limit: Duration) -> Duration {
    loop {
        match ledger
            .try_acquire(&LlmRequest::new(), reserve(0, 100))
            .await
        {
            Ok(permit) if permit.is_global() => {
                permit.release(None);
                assert!(ledger.settled(Duration::from_secs(2)).await);
                return since.elapsed();
            }
            Ok(permit) => panic!("fail closed admits nothing on a floor: {permit:?}"),
            Err(LedgerRefusal::Unavailable(_)) => {}
            Err(other) => panic!("only unavailability while the master fails over: {other:?}"),
        }
        assert!(since.elapsed() < limit, "no admission within {limit:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A replica for the failover tests: renewed every second.
async fn failover_replica(cluster: &RedisCluster, ns: &str, id: &str) -> ExactLedger {
    let config = config(cluster, ns, id)
        .lease(Duration::from_secs(3))
        .renew_every(Duration::from_secs(1));
    ExactLedger::connect(bulkhead(10_000), config)
        .await
        .unwrap()
}

/// The tokens of each hold of `replica` on the node on `port`, smallest first.
fn holds(cluster: &RedisCluster, port: u16, ns: &str, replica: &str) -> Vec<u64> {
    let values: Vec<String> = redis::cmd("HVALS")
        .arg(format!("{ns}:holds:{replica}"))
        .query(&mut cluster.connection(port))
        .unwrap();
    let mut held: Vec<u64> = values
        .iter()
        .map(|v| v.split('|').next().unwrap().parse().unwrap())
        .collect();
    held.sort();
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_failover_loses_nothing_and_admissions_resume() {
    let cluster = RedisCluster::start(3);
    let ns = "{graceful}";
    let slot = cluster.slot(ns);
    let a = failover_replica(&cluster, ns, "a").await;
    let b = failover_replica(&cluster, ns, "b").await;
    let a1 = a
        .try_acquire(&LlmRequest::new(), reserve(1_000, 2_000))
        .await
        .unwrap();
    let b1 = b
        .try_acquire(&LlmRequest::new(), reserve(1_000, 1_000))
        .await
        .unwrap();
    assert_eq!(a.global().await.unwrap(), snapshot(5_000, 2));
    let old = cluster.master_of(slot, cluster.masters()[0]).unwrap();
    let replica = cluster.replica_of(old);

    let started = Instant::now();
    let _: () = redis::cmd("CLUSTER")
        .arg("FAILOVER")
        .query(&mut cluster.connection(replica))
        .unwrap();
    let promoted = cluster.wait_served_elsewhere(slot, old, Duration::from_secs(10));
    let served = started.elapsed();
    assert_eq!(promoted, replica);
    let resumed = until_admitted(&a, started, Duration::from_secs(10)).await;
    let resumed_b = until_admitted(&b, started, Duration::from_secs(10)).await;
    // No call failed during the switch, the renewals included: the old master's MOVED is
    // followed to the new one within the timeout.
    for ledger in [&a, &b] {
        let stats = ledger.stats();
        assert_eq!(
            (stats.store_errors, stats.refused_unavailable),
            (0, 0),
            "{stats:?}"
        );
    }
    eprintln!(
        "graceful failover: slot served by the replica after {served:?}, a admitted after \
         {resumed:?}, b after {resumed_b:?}"
    );
    // Nothing was lost: the manual failover waits for the replica to catch up.
    assert_eq!(b.global().await.unwrap(), snapshot(5_000, 2));
    let seen = observe(&mut cluster.connection(promoted), ns);
    assert_eq!(
        (seen.total, seen.holds, seen.hold_count, seen.replicas),
        (5_000, 5_000, 2, 2)
    );
    assert_eq!(holds(&cluster, promoted, ns, "a"), [3_000]);
    // A renewal period later, no replica was lost, and the count is still exact.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    assert_eq!(a.global().await.unwrap(), snapshot(5_000, 2));
    for ledger in [&a, &b] {
        let stats = ledger.stats();
        assert_eq!(
            (stats.reregistrations, stats.leases_lost),
            (0, 0),
            "{stats:?}"
        );
    }
    a1.release(None);
    b1.release(None);
    assert!(a.settled(Duration::from_secs(2)).await && b.settled(Duration::from_secs(2)).await);
    assert_eq!(a.global().await.unwrap(), snapshot(0, 2));
    assert_eq!((a.close().await.unwrap(), b.close().await.unwrap()), (0, 0));
}

/// `CLUSTER SETSLOT slot NODE id` on the node on `port`.
fn set_slot_node(port: u16, slot: u16, id: &str) {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let _: () = redis::cmd("CLUSTER")
        .arg("SETSLOT")
        .arg(slot)
        .arg("NODE")
        .arg(id)
        .query(&mut client.get_connection().unwrap())
        .unwrap();
}

/// The id of the node on `port`, as it sees itself.
fn node_id(cluster: &RedisCluster, port: u16) -> String {
    cluster
        .view(port)
        .into_iter()
        .find(|v| v.port == port)
        .unwrap()
        .id
}

/// A resharding moves the namespace's slot from its master to another while the replicas
/// call, as `redis-cli --cluster reshard` does: the target imports it, the source migrates
/// it, every key moves (`MIGRATE`), and only then, here 100 ms later (within the ledger's
/// timeout, 1 s here), the slot is handed over (`SETSLOT NODE`, the target first). Between the
/// keys' move and the handover, the source refuses every script unrun with `ASK` (none of its
/// keys is there any more): followed to the target (after `ASKING`), which refuses it with
/// `TRYAGAIN` while a key the script names is missing (a replica without holds has no holds
/// key), so it is sent again until the handover, and the source's `MOVED` is followed. No call
/// fails, and the books are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resharding_of_the_namespace_slot_fails_no_call_and_keeps_the_books() {
    let cluster = RedisCluster::start(3);
    let ns = "{reshard}";
    let slot = cluster.slot(ns);
    let masters = cluster.masters();
    let source = cluster.master_of(slot, masters[0]).unwrap();
    let target = masters
        .iter()
        .copied()
        .find(|&port| port != source)
        .unwrap();
    let (source_id, target_id) = (node_id(&cluster, source), node_id(&cluster, target));
    let open = |id| {
        let config = config(&cluster, ns, id).timeout(Duration::from_secs(1));
        ExactLedger::connect(bulkhead(10_000), config)
    };
    let (a, b) = (open("a").await.unwrap(), open("b").await.unwrap());
    let a1 = a
        .try_acquire(&LlmRequest::new(), reserve(1_000, 1_000))
        .await
        .unwrap();
    let b1 = b
        .try_acquire(&LlmRequest::new(), reserve(500, 500))
        .await
        .unwrap();

    // The migration: importing, migrating, every key of the slot moved in one `MIGRATE`.
    for (port, state, id) in [
        (target, "IMPORTING", &source_id),
        (source, "MIGRATING", &target_id),
    ] {
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(state)
            .arg(id)
            .query(&mut cluster.connection(port))
            .unwrap();
    }
    let keys: Vec<String> = redis::cmd("CLUSTER")
        .arg("GETKEYSINSLOT")
        .arg(slot)
        .arg(100)
        .query(&mut cluster.connection(source))
        .unwrap();
    assert!(keys.contains(&format!("{ns}:holds:a")), "{keys:?}");
    let _: () = redis::cmd("MIGRATE")
        .arg("127.0.0.1")
        .arg(target)
        .arg("")
        .arg(0)
        .arg(5_000)
        .arg("KEYS")
        .arg(&keys)
        .query(&mut cluster.connection(source))
        .unwrap();
    let asked: redis::RedisResult<redis::Value> = redis::cmd("EXISTS")
        .arg(format!("{ns}:total"))
        .query(&mut cluster.connection(source));
    let refusal = asked.unwrap_err();
    assert_eq!(refusal.code(), Some("ASK"), "{refusal:?}");

    // The handover, 100 ms from now, on another thread: every master (the target first).
    let handover = {
        let mut order = vec![target, source];
        order.extend(
            masters
                .iter()
                .copied()
                .filter(|&p| p != target && p != source),
        );
        let target_id = target_id.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            for port in order {
                set_slot_node(port, slot, &target_id);
            }
        })
    };
    // Calls in the window: the first is refused `ASK` at once.
    let started = Instant::now();
    let a2 = a
        .try_acquire(&LlmRequest::new(), reserve(100, 100))
        .await
        .unwrap();
    assert!(a2.is_global());
    let took = started.elapsed();
    // Not before the handover: until then the target refuses it (`TRYAGAIN`: the script names
    // keys this ledger never created, `slices` and `wants` of leased mode among them).
    assert!(took >= Duration::from_millis(90), "{took:?}");
    handover.join().unwrap();
    let b2 = b
        .try_acquire(&LlmRequest::new(), reserve(250, 250))
        .await
        .unwrap();
    eprintln!("resharding: a call made in the window was admitted after {took:?}");
    assert_eq!(a.global().await.unwrap(), snapshot(3_700, 2));
    let seen = observe(&mut cluster.connection(target), ns);
    assert_eq!(
        (seen.total, seen.holds, seen.hold_count, seen.replicas),
        (3_700, 3_700, 4, 2)
    );
    for (port, keys) in keys_by_master(&cluster) {
        if port != target {
            assert!(keys.iter().all(|k| !k.starts_with(ns)), "{port}: {keys:?}");
        }
    }
    for permit in [a1, a2, b1, b2] {
        permit.release(None);
    }
    assert!(a.settled(Duration::from_secs(2)).await && b.settled(Duration::from_secs(2)).await);
    assert_eq!(a.global().await.unwrap(), snapshot(0, 2));
    for ledger in [&a, &b] {
        let stats = ledger.stats();
        assert_eq!(
            (stats.store_errors, stats.refused_unavailable),
            (0, 0),
            "{stats:?}"
        );
    }
    assert_eq!((a.close().await.unwrap(), b.close().await.unwrap()), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_master_loses_its_last_writes_and_the_ledger_recounts_lost_replicas() {
    let mut cluster = RedisCluster::start(3);
    let ns = "{killed}";
    let slot = cluster.slot(ns);
    let old = cluster.master_of(slot, cluster.masters()[0]).unwrap();
    let replica = cluster.replica_of(old);
    let a = failover_replica(&cluster, ns, "a").await;
    let b = failover_replica(&cluster, ns, "b").await;
    let acquire = |ledger: &ExactLedger, tokens: u64| {
        let ledger = ledger.clone();
        async move {
            let permit = ledger
                .try_acquire(&LlmRequest::new(), reserve(0, tokens))
                .await
                .unwrap();
            assert!(permit.is_global());
            permit
        }
    };
    let a1 = acquire(&a, 1_000).await;
    let a2 = acquire(&a, 1_000).await;
    let a3 = acquire(&a, 300).await;
    let b1 = acquire(&b, 2_000).await;
    assert_eq!(a.global().await.unwrap(), snapshot(4_300, 2));
    // Everything so far reached the replica.
    cluster.wait_replicated(old, Duration::from_secs(3));

    // Cut the replication link (the replica frozen, so that it cannot reconnect): what follows
    // reaches only the master, as the last writes before a crash do under asynchronous
    // replication.
    cluster.freeze(replica);
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("replica")
        .query(&mut cluster.connection(old))
        .unwrap();
    assert_eq!(killed, 1);
    let cut = Instant::now();
    // a reserves 700 more and releases its 300; c joins and reserves 500.
    let a4 = acquire(&a, 700).await;
    a3.release(None);
    assert!(a.settled(Duration::from_secs(2)).await);
    let c = failover_replica(&cluster, ns, "c").await;
    let c1 = acquire(&c, 500).await;
    let seen = observe(&mut cluster.connection(old), ns);
    assert_eq!((seen.total, seen.hold_count, seen.replicas), (5_200, 5, 3));
    let frozen = cut.elapsed();

    // The master dies with them.
    cluster.kill(old);
    cluster.thaw(replica);
    let started = Instant::now();
    let promoted = cluster.wait_served_elsewhere(slot, old, Duration::from_secs(15));
    let served = started.elapsed();
    assert_eq!(promoted, replica);
    // The promoted replica has the ledger as it was at the cut, whole scripts only: a's holds
    // 1,000, 1,000 and 300 (its release is lost), b's 2,000; c and its hold are unknown.
    // Unless a replica's renewal came first: c re-registers; a's renewal puts its 700 back,
    // and (at the next) releases its 300.
    let a_holds = holds(&cluster, promoted, ns, "a");
    assert!(
        [
            vec![300, 1_000, 1_000],
            vec![300, 700, 1_000, 1_000],
            vec![700, 1_000, 1_000]
        ]
        .contains(&a_holds),
        "{a_holds:?}"
    );
    assert_eq!(holds(&cluster, promoted, ns, "b"), [2_000]);

    let resumed = until_admitted(&a, started, Duration::from_secs(10)).await;
    // The ledger finds the new master by itself, at once (its probes every 50 ms).
    assert!(
        resumed < served + Duration::from_secs(1),
        "{resumed:?} {served:?}"
    );
    // Within one renewal period (1 s) of the first answer, c's renewal finds its lease gone
    // and puts its live hold back: c is counted exactly again.
    let recounted = async {
        loop {
            if c.stats().reregistrations == 1 {
                return started.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let recounted = tokio::time::timeout(Duration::from_millis(1_500), recounted)
        .await
        .expect("c re-registers within a renewal period");
    // Within one renewal period (1 s) of the promotion, give or take a round trip.
    assert!(
        recounted < served + Duration::from_millis(1_300),
        "{recounted:?} {served:?}"
    );
    let stats = c.stats();
    assert_eq!(
        (stats.reregistrations, stats.reregistered_tokens),
        (1, 500),
        "{stats:?}"
    );
    assert_eq!(holds(&cluster, promoted, ns, "c"), [500]);
    for ledger in [&a, &b] {
        let stats = ledger.stats();
        assert_eq!(
            (stats.reregistrations, stats.leases_lost),
            (0, 0),
            "{stats:?}"
        );
    }
    // What is in flight: a 1,000 + 1,000 + 700, b 2,000, c 500 = 5,200. What the promoted
    // master counted: a's lost reservation (700) missing, its lost release (300) still held:
    // 4,800. a's renewals mend both: the first puts the 700 back and suspects the 300, the
    // next (a renewal period later) releases it. So within two renewal periods of the first
    // answer, the ledger counts exactly what is in flight.
    let mended = async {
        loop {
            if b.global().await.is_ok_and(|g| g == snapshot(5_200, 3)) {
                return started.elapsed();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let mended = tokio::time::timeout(Duration::from_millis(3_000), mended)
        .await
        .expect("a's renewals mend what the promotion lost");
    assert!(
        mended < served + Duration::from_millis(2_300),
        "{mended:?} {served:?}"
    );
    assert_eq!(holds(&cluster, promoted, ns, "a"), [700, 1_000, 1_000]);
    let stats = a.stats();
    assert_eq!(
        (stats.stray_tokens_released, stats.missing_tokens_put_back),
        (300, 700),
        "{stats:?}"
    );
    eprintln!(
        "killed master: replication cut {frozen:?} before the kill; slot served by the replica \
         after {served:?}, a admitted after {resumed:?}, c re-registered after {recounted:?}, \
         the ledger exact again after {mended:?}"
    );

    // Every call ends: nothing is left held.
    for permit in [a1, a2, a4, b1, c1] {
        permit.release(None);
    }
    for ledger in [&a, &b, &c] {
        assert!(ledger.settled(Duration::from_secs(2)).await);
    }
    assert_eq!(a.global().await.unwrap(), snapshot(0, 3));
    assert_eq!(
        (
            a.close().await.unwrap(),
            b.close().await.unwrap(),
            c.close().await.unwrap()
        ),
        (0, 0, 0)
    );
    assert_eq!(b.global().await.unwrap(), snapshot(0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_timeout_bounds_every_call_and_the_connection_to_the_cluster() {
    let cluster = RedisCluster::start(3);
    let ns = "{timeout}";
    let slot = cluster.slot(ns);
    let master = cluster.master_of(slot, cluster.masters()[0]).unwrap();
    let a = replica(&cluster, ns, "a").await;
    // The namespace's master stops answering (for less than the node timeout: no failover):
    // the reservation gives up after the ledger's timeout (300 ms) and fails closed.
    cluster.freeze(master);
    let started = Instant::now();
    let refused = a
        .try_acquire(&LlmRequest::new(), reserve(100, 100))
        .await
        .unwrap_err();
    let waited = started.elapsed();
    cluster.thaw(master);
    let LedgerRefusal::Unavailable(why) = &refused else {
        panic!("unavailable, got {refused:?}")
    };
    // The cluster connection's own response timeout (the ledger's) or the ledger's, whichever
    // fires first.
    assert!(
        ["redis: timed out", "redis: no answer within 300ms"].contains(&why.cause.as_str()),
        "{}",
        why.cause
    );
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_secs(1),
        "{waited:?}"
    );
    eprintln!(
        "frozen master: the reservation gave up after {waited:?}: {}",
        why.cause
    );
    until_admitted(&a, Instant::now(), Duration::from_secs(5)).await;

    // A PING goes to the namespace's master only (a cluster client would send it to every
    // master): another master frozen does not fail it.
    let other = cluster
        .masters()
        .into_iter()
        .find(|&port| port != master)
        .unwrap();
    cluster.freeze(other);
    let pinged = a.ping().await;
    cluster.thaw(other);
    pinged.unwrap();

    // No node answers: opening the cluster connection gives up within four timeouts.
    let quick = config(&cluster, ns, "b").timeout(Duration::from_millis(100));
    let ports: Vec<u16> = cluster.nodes.iter().map(|n| n.port).collect();
    for &port in &ports {
        cluster.freeze(port);
    }
    let started = Instant::now();
    let refused = ExactLedger::connect(bulkhead(10_000), quick).await;
    let waited = started.elapsed();
    for &port in &ports {
        cluster.thaw(port);
    }
    assert!(
        matches!(
            refused,
            Err(async_bulkhead_llm_redis::LedgerError::Store(_))
        ),
        "{:?}",
        refused.err()
    );
    assert!(waited < Duration::from_millis(400 + 300), "{waited:?}");
    eprintln!(
        "frozen cluster: the connection gave up after {waited:?}: {}",
        refused.err().unwrap()
    );
    until_admitted(&a, Instant::now(), Duration::from_secs(5)).await;
    assert_eq!(a.global().await.unwrap(), snapshot(0, 1));
}
