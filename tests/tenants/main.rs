//! Per-tenant limits (`Tenants`): tenants created on first use from the template with per-key
//! limits, independent limits, the `max_tenants` bound (eviction of idle tenants by a bounded
//! clock, `Full` while they are busy), no eviction with a call in flight or queued, template
//! errors and panics storing nothing, one instance per key under concurrent first use, and a
//! sharded family under a flood of unknown keys (the bound held across shards, eviction found
//! in other shards, known tenants served throughout).

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod within;

use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::pin::pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::task::{Context, Poll};
use std::thread;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, RejectReason, TokenBudget,
    builder::ConfigError,
    limits::{ApplyOutcome, LimitsError},
    tenants::{PolicyError, TenantPolicy, Tenants, TenantsConfigError, TenantsError},
};

/// An `idle_after` short enough for tests, long enough that two consecutive steps of a test
/// never take it (a tenant refreshed by one step is not idle at the next).
const IDLE: Duration = Duration::from_millis(100);

/// Sleeps long enough that a tenant last active before the sleep has been idle for `IDLE`.
fn past_idle() {
    thread::sleep(IDLE + Duration::from_millis(50));
}

fn req() -> LlmRequest {
    LlmRequest::new()
}

fn opts() -> AcquireOptions {
    AcquireOptions::new()
}

/// A family of one-slot tenants, counting the template's calls.
fn one_slot(max_tenants: usize, idle_after: Duration) -> (Tenants<String>, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let tenants = Tenants::builder(move |_: &String| {
        counter.fetch_add(1, Ordering::SeqCst);
        LlmBulkhead::builder("m", 1)
    })
    .max_tenants(max_tenants)
    .idle_after(idle_after)
    .build()
    .expect("valid configuration");
    (tenants, calls)
}

fn sorted_keys(tenants: &Tenants<String>) -> Vec<String> {
    let mut keys = tenants.keys();
    keys.sort();
    keys
}

#[test]
fn created_on_first_use_with_the_templates_limits_for_the_key() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let tenants = Tenants::builder(move |tenant: &String| {
        counter.fetch_add(1, Ordering::SeqCst);
        match tenant.as_str() {
            "pro" => LlmBulkhead::builder("gpt-4o", 3).token_budget(TokenBudget::new(9_000)),
            _ => LlmBulkhead::builder("gpt-4o-mini", 1).token_budget(TokenBudget::new(1_000)),
        }
    })
    .build()
    .unwrap();
    assert_eq!((tenants.len(), calls.load(Ordering::SeqCst)), (0, 0));
    assert!(tenants.peek("pro").is_none() && tenants.stats("pro").is_none());
    assert_eq!((tenants.len(), calls.load(Ordering::SeqCst)), (0, 0)); // looking creates nothing

    let pro = tenants.get("pro").unwrap();
    assert_eq!(pro.model(), "gpt-4o");
    assert_eq!(pro.limits(), Limits::new(0, 3).with_token_budget(9_000, 0));
    let free = tenants.get(&"free".to_string()).unwrap();
    assert_eq!(free.model(), "gpt-4o-mini");
    assert_eq!(free.limits(), Limits::new(0, 1).with_token_budget(1_000, 0));
    assert_eq!((tenants.len(), calls.load(Ordering::SeqCst)), (2, 2));

    // Later gets return the same instance and do not call the template.
    let _permit = pro.try_acquire(&req(), opts()).unwrap();
    assert_eq!(tenants.get("pro").unwrap().stats().in_flight, 1);
    assert_eq!(tenants.stats("pro").unwrap().admitted, 1);
    assert_eq!((tenants.len(), calls.load(Ordering::SeqCst)), (2, 2));
    assert_eq!(sorted_keys(&tenants), ["free", "pro"]);
}

#[test]
fn each_tenants_limits_are_its_own() {
    let (tenants, _) = one_slot(8, IDLE);
    let a = tenants.get("a").unwrap();
    let b = tenants.get("b").unwrap();

    // `a` full refuses only `a`'s calls.
    let held = a.try_acquire(&req(), opts()).unwrap();
    let refused = a.try_acquire(&req(), opts()).unwrap_err();
    assert_eq!(
        refused.rejection().unwrap().reason(),
        RejectReason::ConcurrencyLimit
    );
    let admitted = b.try_acquire(&req(), opts()).unwrap();
    assert_eq!(tenants.stats("a").unwrap().rejected, 1);
    assert_eq!(tenants.stats("b").unwrap().rejected, 0);

    // apply_limits on `a` changes only `a`.
    let outcome = tenants.apply_limits("a", Limits::new(1, 2)).unwrap();
    assert_eq!(
        outcome,
        Some(ApplyOutcome::Applied {
            previous: Limits::new(0, 1),
            current: Limits::new(1, 2)
        })
    );
    assert_eq!(a.limits(), Limits::new(1, 2));
    assert_eq!(b.limits(), Limits::new(0, 1));
    let second = a.try_acquire(&req(), opts()).unwrap();
    assert_eq!(tenants.stats("a").unwrap().in_flight, 2);
    let refused = b.try_acquire(&req(), opts()).unwrap_err();
    assert_eq!(
        refused.rejection().unwrap().reason(),
        RejectReason::ConcurrencyLimit
    );

    // A stale revision changes nothing; an invalid snapshot is the bulkhead's error.
    assert_eq!(
        tenants.apply_limits("a", Limits::new(1, 7)).unwrap(),
        Some(ApplyOutcome::Stale {
            current: Limits::new(1, 2)
        })
    );
    assert!(
        tenants
            .apply_limits("a", Limits::new(2, 1).with_token_budget(10, 0))
            .is_err()
    );
    // An unknown key: nothing applied, nothing created.
    assert_eq!(tenants.apply_limits("c", Limits::new(1, 5)).unwrap(), None);
    assert_eq!(tenants.len(), 2);
    drop((held, admitted, second));
}

#[test]
fn a_new_key_evicts_the_least_recently_active_idle_tenant() {
    let (tenants, calls) = one_slot(2, IDLE);
    tenants.get("a").unwrap();
    thread::sleep(Duration::from_millis(5));
    tenants.get("b").unwrap();
    past_idle();

    // Both idle past IDLE: the older, `a`, goes.
    let c = tenants.get("c").unwrap();
    assert_eq!(sorted_keys(&tenants), ["b", "c"]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);

    // A get refreshes: after it `b` is the most recent; `c` (idle past IDLE) goes.
    drop(c);
    past_idle();
    tenants.get("b").unwrap();
    tenants.get("a").unwrap();
    assert_eq!(sorted_keys(&tenants), ["a", "b"]);

    // Neither has been idle for IDLE now: a fourth key is refused, the template not called.
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    let err = tenants.get("d").unwrap_err();
    assert_eq!(err, TenantsError::Full { max: 2 });
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_eq!(sorted_keys(&tenants), ["a", "b"]);

    // An explicit sweep once both have been idle.
    past_idle();
    assert_eq!(tenants.evict_idle(), 2);
    assert!(tenants.is_empty());
}

#[test]
fn a_new_key_is_refused_full_while_every_tenant_is_busy() {
    let (tenants, calls) = one_slot(2, Duration::ZERO);
    let a = tenants
        .get("a")
        .unwrap()
        .try_acquire_owned(&req(), opts())
        .unwrap();
    let b = tenants
        .get("b")
        .unwrap()
        .try_acquire_owned(&req(), opts())
        .unwrap();
    let err = tenants.get("c").unwrap_err();
    assert_eq!(err, TenantsError::Full { max: 2 });
    assert_eq!(
        err.to_string(),
        "all 2 tenants (max_tenants) are busy or active within idle_after: none can be evicted"
    );
    assert_eq!((tenants.len(), calls.load(Ordering::SeqCst)), (2, 2)); // nothing built

    // `a` released: the first check after its release sees its counters changed (activity
    // now), so even with a zero `idle_after` it is evicted only at the next check.
    drop(a);
    assert_eq!(tenants.get("c").unwrap_err(), TenantsError::Full { max: 2 });
    tenants.get("c").unwrap();
    assert_eq!(sorted_keys(&tenants), ["b", "c"]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    drop(b);
}

#[test]
fn no_eviction_while_a_call_is_in_flight_or_queued() {
    let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1).max_queue(1))
        .max_tenants(1)
        .idle_after(Duration::from_millis(20))
        .build()
        .unwrap();
    let a = tenants.get("a").unwrap();
    let held = a.try_acquire(&req(), opts()).unwrap();
    let mut waiter = pin!(a.acquire_owned(&req(), opts()));
    let mut cx = Context::from_waker(std::task::Waker::noop());
    assert!(waiter.as_mut().poll(&mut cx).is_pending());
    let stats = tenants.stats("a").unwrap();
    assert_eq!((stats.in_flight, stats.pending), (1, 1));

    // In flight and queued, long past idle_after: kept, by a sweep and by a new key.
    thread::sleep(Duration::from_millis(40));
    assert_eq!(tenants.evict_idle(), 0);
    assert_eq!(tenants.get("b").unwrap_err(), TenantsError::Full { max: 1 });

    // The waiter is handed the slot: in flight only, still kept.
    drop(held);
    let Poll::Ready(Ok(permit)) = waiter.as_mut().poll(&mut cx) else {
        panic!("the waiter was handed the slot");
    };
    let stats = tenants.stats("a").unwrap();
    assert_eq!((stats.in_flight, stats.pending), (1, 0));
    thread::sleep(Duration::from_millis(40));
    assert_eq!(tenants.evict_idle(), 0);

    // Released: idle from the check that notices it, evicted once idle_after has passed.
    drop(permit);
    assert_eq!(tenants.evict_idle(), 0);
    assert_eq!(tenants.keys(), ["a"]);
    thread::sleep(Duration::from_millis(40));
    assert_eq!(tenants.evict_idle(), 1);
    assert!(tenants.is_empty());
}

#[test]
fn calls_through_a_kept_clone_count_as_activity() {
    let (tenants, _) = one_slot(1, IDLE);
    let a = tenants.get("a").unwrap();
    past_idle();
    // Used through the clone, not through `get`, since the last check: the sweep sees the
    // counters moved, and keeps it.
    drop(a.try_acquire(&req(), opts()).unwrap());
    assert_eq!(tenants.evict_idle(), 0);
    past_idle();
    assert_eq!(tenants.evict_idle(), 1);
}

#[test]
fn eviction_forgets_applied_limits_and_spares_kept_clones() {
    let (tenants, calls) = one_slot(1, Duration::ZERO);
    let old = tenants.get("a").unwrap();
    tenants.apply_limits("a", Limits::new(1, 5)).unwrap();
    assert_eq!(tenants.evict_idle(), 1);

    // A fresh instance, from the template again.
    let fresh = tenants.get("a").unwrap();
    assert_eq!(fresh.limits(), Limits::new(0, 1));
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // The old clone still works, on its own capacity.
    let p1 = old.try_acquire(&req(), opts()).unwrap();
    let p2 = old.try_acquire(&req(), opts()).unwrap();
    assert_eq!(old.stats().in_flight, 2);
    assert_eq!(tenants.stats("a").unwrap().in_flight, 0);
    drop((p1, p2));
}

#[test]
fn remove_takes_a_tenant_out_whatever_it_does() {
    let (tenants, _) = one_slot(4, IDLE);
    let permit = tenants
        .get("a")
        .unwrap()
        .try_acquire_owned(&req(), opts())
        .unwrap();
    let removed = tenants.remove("a").unwrap();
    assert_eq!(removed.stats().in_flight, 1);
    assert!(tenants.remove("a").is_none());
    assert_eq!(tenants.get("a").unwrap().stats().in_flight, 0);
    drop(permit);
    assert_eq!(removed.stats().in_flight, 0);
}

#[test]
fn a_template_error_is_returned_and_stores_nothing() {
    let tenants = Tenants::builder(|tenant: &String| {
        let slots = if tenant == "huge" { 70_000 } else { 1 };
        LlmBulkhead::builder("m", slots)
    })
    .max_tenants(1)
    .idle_after(Duration::ZERO)
    .build()
    .unwrap();
    let err = tenants.get("huge").unwrap_err();
    assert_eq!(
        err,
        TenantsError::Template(ConfigError::MaxConcurrentTooLarge {
            value: 70_000,
            max: 65_535
        })
    );
    assert_eq!(
        err.to_string(),
        "the template's builder was refused: max_concurrent (70000) must be <= 65535"
    );
    assert!(std::error::Error::source(&err).is_some());
    assert!(tenants.is_empty());

    // With the map full of an evictable tenant, a failed build evicts nothing.
    tenants.get("ok").unwrap();
    assert!(tenants.get("huge").is_err());
    assert_eq!(tenants.keys(), ["ok"]);
}

#[test]
fn a_panicking_template_reaches_the_caller_and_stores_nothing() {
    let tenants = Tenants::builder(|tenant: &String| {
        assert!(tenant != "boom", "template panic");
        LlmBulkhead::builder("m", 1)
    })
    .build()
    .unwrap();
    let result = catch_unwind(AssertUnwindSafe(|| tenants.get("boom")));
    assert!(result.is_err());
    assert!(tenants.is_empty());
    // No lock was held: the family goes on working.
    tenants.get("fine").unwrap();
    assert_eq!(tenants.keys(), ["fine"]);
}

#[test]
fn max_tenants_must_be_at_least_one() {
    let err = Tenants::builder(|_: &u64| LlmBulkhead::builder("m", 1))
        .max_tenants(0)
        .build()
        .unwrap_err();
    assert_eq!(err, TenantsConfigError::MaxTenantsZero);
    assert_eq!(err.to_string(), "max_tenants (0) must be >= 1");
    let one = Tenants::builder(|_: &u64| LlmBulkhead::builder("m", 1))
        .max_tenants(1)
        .build()
        .unwrap();
    assert_eq!(
        (one.max_tenants(), one.idle_after()),
        (1, Duration::from_secs(60))
    );
}

#[test]
fn concurrent_first_gets_of_one_key_yield_one_instance() {
    const THREADS: usize = 8;
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    let tenants = Tenants::builder(move |_: &String| {
        counter.fetch_add(1, Ordering::SeqCst);
        LlmBulkhead::builder("m", 4)
    })
    .build()
    .unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let handles: Vec<_> = (0..THREADS)
        .map(|_| {
            let tenants = tenants.clone();
            let barrier = barrier.clone();
            thread::spawn(move || {
                barrier.wait();
                tenants.get("shared").unwrap()
            })
        })
        .collect();
    let clones: Vec<LlmBulkhead> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(tenants.len(), 1);
    // Racing first gets may each build (1 to 8 template calls), but one instance is kept.
    assert!((1..=THREADS).contains(&calls.load(Ordering::SeqCst)));

    // An admission through one clone is seen by every other.
    let permit = clones[0].try_acquire(&req(), opts()).unwrap();
    for clone in &clones {
        let stats = clone.stats();
        assert_eq!((stats.in_flight, stats.admitted), (1, 1));
    }
    assert_eq!(tenants.stats("shared").unwrap().in_flight, 1);
    drop(permit);
    assert!(clones.iter().all(|c| c.stats().in_flight == 0));
}

/// A family of 1,000 one-slot tenants (16 shards), every place taken by an idle tenant past
/// `IDLE`: each new key evicts one, wherever its key's shard is, and the bound holds.
#[test]
fn new_keys_evict_across_shards_and_the_bound_holds() {
    let (tenants, calls) = one_slot(1_000, IDLE);
    for i in 0..1_000 {
        tenants.get(&format!("old-{i}")).unwrap();
    }
    assert_eq!(tenants.len(), 1_000);
    past_idle();
    // Every new key finds room: in its own shard, or in the shards the clock visits next.
    for i in 0..1_000 {
        tenants.get(&format!("new-{i}")).unwrap();
        assert!(tenants.len() <= 1_000);
    }
    assert_eq!(tenants.len(), 1_000);
    assert!(tenants.keys().iter().all(|k| k.starts_with("new-")));
    assert_eq!(calls.load(Ordering::SeqCst), 2_000);
}

/// Every place busy (a call in flight on each): a flood of unknown keys is refused `Full`
/// without building anything, while the known tenants are served, and the family is unchanged.
#[test]
fn a_flood_of_unknown_keys_on_a_busy_family_builds_nothing_and_serves_the_known() {
    let (tenants, calls) = one_slot(1_000, Duration::ZERO);
    let held: Vec<_> = (0..1_000)
        .map(|i| {
            tenants
                .get(&format!("busy-{i}"))
                .unwrap()
                .try_acquire_owned(&req(), opts())
                .unwrap()
        })
        .collect();
    let flood = {
        let tenants = tenants.clone();
        thread::spawn(move || {
            for i in 0..20_000 {
                let key = format!("flood-{i}");
                assert_eq!(
                    tenants.get(&key).unwrap_err(),
                    TenantsError::Full { max: 1_000 }
                );
            }
        })
    };
    for round in 0..2_000 {
        let key = format!("busy-{}", round % 1_000);
        assert_eq!(tenants.get(&key).unwrap().stats().in_flight, 1);
    }
    flood.join().unwrap();
    assert_eq!(tenants.len(), 1_000);
    assert_eq!(calls.load(Ordering::SeqCst), 1_000); // the flood built nothing
    drop(held);
}

/// Threads racing new keys into a small sharded family, with evictions: never more than
/// `max_tenants`, and every tenant counted once.
#[test]
fn racing_new_keys_never_exceed_the_bound() {
    let (tenants, _calls) = one_slot(128, Duration::ZERO);
    let barrier = Arc::new(Barrier::new(4));
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let (tenants, barrier) = (tenants.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                let mut admitted = 0;
                for i in 0..5_000 {
                    if tenants.get(&format!("{t}-{i}")).is_ok() {
                        admitted += 1;
                    }
                    assert!(tenants.len() <= 128);
                }
                admitted
            })
        })
        .collect();
    let admitted: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(admitted >= 128, "only {admitted} new keys got a tenant");
    assert_eq!(tenants.len(), tenants.keys().len());
    assert!(tenants.len() <= 128);
    // Every place can still be freed and taken: nothing leaked from the count.
    let keys = tenants.keys();
    for key in &keys {
        tenants.remove(key.as_str());
    }
    assert!(tenants.is_empty());
    for i in 0..128 {
        tenants.get(&format!("again-{i}")).unwrap();
    }
    assert_eq!(tenants.len(), 128);
}

/// A family of one-slot tenants under `policy`.
fn with_policy(max_tenants: usize, policy: TenantPolicy) -> Tenants<String> {
    Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
        .max_tenants(max_tenants)
        .idle_after(IDLE)
        .policy(policy)
        .build()
        .expect("valid configuration")
}

#[test]
fn a_policy_gives_each_new_tenant_its_limits_and_the_default_to_the_rest() {
    let policy = TenantPolicy::new(3, Limits::new(0, 2)).tenant("ent-acme", Limits::new(0, 16));
    let tenants = with_policy(10, policy);
    let acme = tenants.get("ent-acme").unwrap().limits();
    let bob = tenants.get("bob").unwrap().limits();
    assert_eq!((acme.revision, acme.max_concurrent), (3, 16));
    assert_eq!((bob.revision, bob.max_concurrent), (3, 2));
    assert_eq!(tenants.policy().unwrap().revision, 3);
}

#[test]
fn a_newer_policy_reaches_every_live_tenant_and_a_stale_one_changes_nothing() {
    let tenants = with_policy(10, TenantPolicy::new(1, Limits::new(0, 2)));
    let acme = tenants.get("acme").unwrap();
    let bob = tenants.get("bob").unwrap();
    let next = TenantPolicy::new(5, Limits::new(0, 3)).tenant("acme", Limits::new(0, 9));
    match tenants.apply_policy(next.clone()).unwrap() {
        ApplyOutcome::Applied { previous, current } => {
            assert_eq!((previous.revision, current), (1, next.clone()));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        (acme.limits().revision, acme.limits().max_concurrent),
        (5, 9)
    );
    assert_eq!((bob.limits().revision, bob.limits().max_concurrent), (5, 3));
    let stale = TenantPolicy::new(5, Limits::new(0, 1));
    assert_eq!(
        tenants.apply_policy(stale).unwrap(),
        ApplyOutcome::Stale { current: next }
    );
    assert_eq!(bob.limits().max_concurrent, 3);
}

#[test]
fn a_policy_that_does_not_fit_a_live_tenant_changes_nothing() {
    let tenants = with_policy(10, TenantPolicy::new(1, Limits::new(0, 2)));
    let acme = tenants.get("acme").unwrap();
    // A token budget for tenants built without one.
    let budgeted = Limits::new(0, 4).with_token_budget(1_000, 0);
    let err = tenants
        .apply_policy(TenantPolicy::new(2, Limits::new(0, 4)).tenant("acme", budgeted))
        .unwrap_err();
    assert_eq!(
        err,
        PolicyError::Tenant {
            key: "acme".into(),
            error: LimitsError::TokenBudgetNotConfigured
        }
    );
    assert_eq!(
        (acme.limits().revision, acme.limits().max_concurrent),
        (1, 2)
    );
    assert_eq!(tenants.policy().unwrap().revision, 1);
    assert_eq!(
        tenants.apply_policy(TenantPolicy::new(0, Limits::new(0, 4))),
        Err(PolicyError::RevisionZero)
    );
    let plain = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
        .build()
        .unwrap();
    assert_eq!(
        plain.apply_policy(TenantPolicy::new(1, Limits::new(0, 4))),
        Err(PolicyError::NotConfigured)
    );
    let refused = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
        .policy(TenantPolicy::new(0, Limits::new(0, 4)))
        .build()
        .unwrap_err();
    assert_eq!(
        refused,
        TenantsConfigError::Policy(PolicyError::RevisionZero)
    );
}

#[test]
fn a_new_key_whose_policy_does_not_fit_is_refused_and_nothing_is_stored() {
    let budgeted = Limits::new(0, 4).with_token_budget(1_000, 0);
    let tenants = with_policy(
        10,
        TenantPolicy::new(1, Limits::new(0, 2)).tenant("odd", budgeted),
    );
    assert_eq!(
        tenants.get("odd").unwrap_err(),
        TenantsError::Policy(LimitsError::TokenBudgetNotConfigured)
    );
    assert!(tenants.is_empty());
    tenants.get("even").unwrap();
    assert_eq!(tenants.len(), 1);
}

/// The policy outlives the bulkheads: a tenant evicted and created again starts with the
/// policy's limits, not the template's.
#[test]
fn an_evicted_tenant_comes_back_with_the_policys_limits() {
    let tenants = with_policy(1, TenantPolicy::new(1, Limits::new(0, 2)));
    tenants.get("acme").unwrap();
    tenants
        .apply_policy(TenantPolicy::new(2, Limits::new(0, 2)).tenant("acme", Limits::new(0, 7)))
        .unwrap();
    past_idle();
    tenants.get("bob").unwrap(); // evicts acme
    assert_eq!(sorted_keys(&tenants), ["bob"]);
    past_idle();
    let acme = tenants.get("acme").unwrap(); // evicts bob, builds acme again
    assert_eq!(
        (acme.limits().revision, acme.limits().max_concurrent),
        (2, 7)
    );
}

#[cfg(feature = "serde")]
#[test]
fn a_policy_is_read_from_json() {
    let json = r#"{
        "revision": 4,
        "default": {"max_concurrent": 2},
        "tenants": {"ent-acme": {"max_concurrent": 16, "max_queue": 8}}
    }"#;
    let policy: TenantPolicy = serde_json::from_str(json).unwrap();
    let tenants = with_policy(10, policy);
    let acme = tenants.get("ent-acme").unwrap().limits();
    assert_eq!(
        (acme.revision, acme.max_concurrent, acme.max_queue),
        (4, 16, 8)
    );
    assert_eq!(tenants.get("x").unwrap().limits().max_concurrent, 2);
}

/// Policies installed while other threads create tenants: once both are done, every live
/// tenant has the last policy's limits (none created with an older one is missed).
#[test]
fn policies_racing_new_tenants_reach_every_tenant() {
    let tenants = with_policy(10_000, TenantPolicy::new(1, Limits::new(0, 1)));
    let barrier = Arc::new(Barrier::new(3));
    let creators: Vec<_> = (0..2)
        .map(|t| {
            let (tenants, barrier) = (tenants.clone(), barrier.clone());
            thread::spawn(move || {
                barrier.wait();
                for i in 0..2_000 {
                    tenants.get(&format!("{t}-{i}")).unwrap();
                }
            })
        })
        .collect();
    barrier.wait();
    for revision in 2..=60u32 {
        let next = TenantPolicy::new(u64::from(revision), Limits::new(0, revision));
        assert!(tenants.apply_policy(next).unwrap().is_applied());
    }
    for creator in creators {
        creator.join().unwrap();
    }
    assert_eq!(tenants.len(), 4_000);
    for key in tenants.keys() {
        let limits = tenants.peek(key.as_str()).unwrap().limits();
        assert_eq!((limits.revision, limits.max_concurrent), (60, 60), "{key}");
    }
}

/// The hooks hear every creation and every removal (evicted for room, swept, removed), once
/// each, with the key and the bulkhead; a panicking hook is counted and changes nothing.
#[test]
fn the_hooks_hear_every_creation_and_removal_once() {
    let created = Arc::new(std::sync::Mutex::new(Vec::new()));
    let removed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (c, r) = (created.clone(), removed.clone());
    let tenants = Tenants::builder(|key: &String| {
        if key == "panic" {
            LlmBulkhead::builder("m", 2)
        } else {
            LlmBulkhead::builder("m", 1)
        }
    })
    .max_tenants(2)
    .idle_after(IDLE)
    .on_created(move |key: &String, bulkhead| {
        if bulkhead.limits().max_concurrent == 2 {
            panic!("a hook that fails");
        }
        c.lock().unwrap().push(key.clone());
    })
    .on_removed(move |key: &String, _| r.lock().unwrap().push(key.clone()))
    .build()
    .unwrap();
    tenants.get("a").unwrap();
    tenants.get("a").unwrap();
    tenants.get("b").unwrap();
    past_idle();
    tenants.get("c").unwrap(); // evicts one of a, b
    assert_eq!(removed.lock().unwrap().len(), 1);
    assert!(tenants.remove("c").is_some());
    past_idle();
    assert_eq!(tenants.evict_idle(), 1);
    assert_eq!(*created.lock().unwrap(), ["a", "b", "c"]);
    let mut gone = removed.lock().unwrap().clone();
    gone.sort();
    assert_eq!(gone, ["a", "b", "c"]);
    // A panicking creation hook: counted, the tenant served all the same.
    assert_eq!(tenants.get("panic").unwrap().limits().max_concurrent, 2);
    assert_eq!(tenants.hook_panics(), 1);
    assert_eq!(tenants.len(), 1);
}
