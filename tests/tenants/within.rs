//! A tenant within global limits, decided together (`try_acquire_within`, `acquire_within`):
//! each level counts only what it decided, a refusal names its level, both holds move with
//! usage and return exactly, a wait for a global slot holds the tenant's slot uncounted, and
//! under threads no level is ever over its limits and every count adds up.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Context;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget,
    TokenUsage,
    classes::{AdmissionClasses, ClassLimits},
    events::{Event, EventKind},
    rejection::Scope,
};

fn bulkhead(max: usize, budget: Option<u64>) -> LlmBulkhead {
    let builder = LlmBulkhead::builder("m", max).max_queue(8);
    match budget {
        Some(tokens) => builder.token_budget(TokenBudget::new(tokens)),
        None => builder,
    }
    .build()
    .unwrap()
}

fn scope_and_reason(error: &AcquireError) -> (Option<Scope>, RejectReason) {
    let rejection = error.rejection().expect("a capacity refusal");
    (rejection.scope(), rejection.reason())
}

#[test]
fn a_tenant_refusal_never_reaches_the_global_level() {
    let global = bulkhead(8, Some(10_000));
    let tenant = bulkhead(1, Some(10_000));
    let request = LlmRequest::new().user("x".repeat(400)).max_tokens(100);
    let held = tenant
        .try_acquire_within(&global, &request, AcquireOptions::new())
        .unwrap();
    let err = tenant
        .try_acquire_within(&global, &request, AcquireOptions::new())
        .unwrap_err();
    assert_eq!(
        scope_and_reason(&err),
        (Some(Scope::Tenant), RejectReason::ConcurrencyLimit)
    );
    assert_eq!(err.rejection().unwrap().detail().max_concurrent, 1);
    assert!(
        err.to_string().contains("tenant bulkhead rejected"),
        "{err}"
    );
    let (t, g) = (tenant.stats(), global.stats());
    assert_eq!((t.admitted, t.rejected, t.in_flight), (1, 1, 1));
    assert_eq!((g.admitted, g.rejected, g.in_flight), (1, 0, 1));
    drop(held);
    let (t, g) = (tenant.stats(), global.stats());
    assert_eq!(
        (t.released, t.in_flight, g.released, g.in_flight),
        (1, 0, 1, 0)
    );
    assert_eq!(t.token_budget.unwrap().in_flight_tokens, 0);
    assert_eq!(g.token_budget.unwrap().in_flight_tokens, 0);
}

#[test]
fn a_global_refusal_counts_nothing_at_the_tenant_and_gives_its_capacity_back() {
    let global = bulkhead(1, Some(10_000));
    let (a, b) = (bulkhead(4, Some(5_000)), bulkhead(4, Some(5_000)));
    let options = AcquireOptions::new().reservation(Reservation::new(100, 900).unwrap());
    let request = LlmRequest::new();
    let held = a.try_acquire_within(&global, &request, options).unwrap();
    let err = b
        .try_acquire_within(&global, &request, options)
        .unwrap_err();
    assert_eq!(
        scope_and_reason(&err),
        (Some(Scope::Global), RejectReason::ConcurrencyLimit)
    );
    assert!(
        err.to_string().starts_with("global bulkhead rejected"),
        "{err}"
    );
    let tb = b.stats();
    assert_eq!(
        (tb.admitted, tb.rejected, tb.in_flight, tb.released),
        (0, 0, 0, 0)
    );
    let budget = tb.token_budget.unwrap();
    assert_eq!((budget.in_flight_tokens, budget.total_reserved), (0, 0));
    assert_eq!(budget.total_returned_unreported, 0);
    let g = global.stats();
    assert_eq!((g.admitted, g.rejected), (1, 1));
    // The global budget refuses too, scoped the same way.
    drop(held);
    let big = bulkhead(4, Some(100_000));
    let too_big = AcquireOptions::new().reservation(Reservation::new(9_000, 2_000).unwrap());
    let err = big
        .try_acquire_within(&global, &request, too_big)
        .unwrap_err();
    assert_eq!(
        scope_and_reason(&err),
        (Some(Scope::Global), RejectReason::BudgetLimit)
    );
    assert_eq!(big.stats().token_budget.unwrap().in_flight_tokens, 0);
}

#[test]
fn both_levels_hold_the_same_reservation_sized_once_and_settle_alike() {
    let global = bulkhead(8, Some(100_000));
    let tenant = bulkhead(2, Some(10_000));
    let request = LlmRequest::new().user("x".repeat(400)).max_tokens(100);
    let mut permit = tenant
        .try_acquire_within(&global, &request, AcquireOptions::new())
        .unwrap();
    let expected = global.estimate(&request).unwrap().unwrap();
    assert_eq!(permit.global().reservation(), Some(expected));
    assert_eq!(permit.tenant().reservation(), Some(expected));
    assert_ne!(
        permit.tenant().admission_id(),
        permit.global().admission_id()
    );
    let report = permit
        .report_usage(TokenUsage::new(60, 30).unwrap())
        .unwrap();
    assert_eq!(report.held, 160);
    assert_eq!(tenant.stats().token_budget.unwrap().in_flight_tokens, 160);
    assert_eq!(global.stats().token_budget.unwrap().in_flight_tokens, 160);
    let report = permit.release(Some(TokenUsage::new(60, 80).unwrap()));
    assert_eq!(report.tenant, report.global);
    for stats in [tenant.stats(), global.stats()] {
        let budget = stats.token_budget.unwrap();
        assert_eq!((stats.admitted, stats.released, stats.in_flight), (1, 1, 0));
        assert_eq!((budget.in_flight_tokens, budget.total_consumed), (0, 140));
    }
}

#[test]
fn without_a_global_budget_the_tenant_sizes_the_call() {
    let global = bulkhead(8, None);
    let tenant = bulkhead(2, Some(10_000));
    let request = LlmRequest::new().user("x".repeat(400)).max_tokens(100);
    let permit = tenant
        .try_acquire_within(&global, &request, AcquireOptions::new())
        .unwrap();
    assert_eq!(permit.tenant().held_tokens(), 200);
    assert_eq!(permit.global().reservation(), None);
    drop(permit);
    assert_eq!(tenant.stats().token_budget.unwrap().in_flight_tokens, 0);
}

#[test]
fn an_invalid_call_changes_nothing_at_either_level() {
    let global = bulkhead(8, Some(10_000));
    let tenant = LlmBulkhead::builder("m", 2)
        .admission_classes(AdmissionClasses::new("a").class("a", ClassLimits::new()))
        .build()
        .unwrap();
    // A class of the tenant's: the options' class is the global bulkhead's, which has none.
    let class = tenant.class("a").unwrap();
    let err = tenant
        .try_acquire_within(
            &global,
            &LlmRequest::new(),
            AcquireOptions::new().class(class),
        )
        .unwrap_err();
    assert!(matches!(err, AcquireError::Invalid(_)), "{err:?}");
    for stats in [tenant.stats(), global.stats()] {
        assert_eq!((stats.admitted, stats.rejected, stats.in_flight), (0, 0, 0));
    }
}

#[test]
fn the_global_class_decides_the_global_level_and_the_tenant_takes_its_default() {
    let global = LlmBulkhead::builder("m", 2)
        .admission_classes(
            AdmissionClasses::new("batch")
                .class("premium", ClassLimits::new().protected_concurrent(1))
                .class("batch", ClassLimits::new()),
        )
        .build()
        .unwrap();
    let tenant = LlmBulkhead::builder("m", 4)
        .admission_classes(AdmissionClasses::new("own").class("own", ClassLimits::new()))
        .build()
        .unwrap();
    let premium = AcquireOptions::new().class(global.class("premium").unwrap());
    let batch = AcquireOptions::new();
    let request = LlmRequest::new();
    let first = tenant.try_acquire_within(&global, &request, batch).unwrap();
    assert_eq!(first.global().class().unwrap().id(), "batch");
    assert_eq!(first.tenant().class().unwrap().id(), "own");
    // The one shared slot is taken: batch is refused by the global level's protection.
    let err = tenant
        .try_acquire_within(&global, &request, batch)
        .unwrap_err();
    assert_eq!(scope_and_reason(&err).0, Some(Scope::Global));
    let second = tenant
        .try_acquire_within(&global, &request, premium)
        .unwrap();
    assert_eq!(second.global().class().unwrap().id(), "premium");
    let own = tenant.stats();
    assert_eq!((own.admitted, own.rejected, own.in_flight), (2, 0, 2));
    drop((first, second));
    assert_eq!(tenant.stats().in_flight, 0);
    assert_eq!(global.stats().in_flight, 0);
}

#[test]
fn events_announce_each_level_s_own_decisions_only() {
    let global = bulkhead(1, None);
    let tenant = bulkhead(1, None);
    let heard = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&heard);
    let _subscription = tenant.on_events([EventKind::Admit, EventKind::Reject], move |event| {
        let seen = match event {
            Event::Admit(_) => "admit".to_owned(),
            Event::Reject(reject) => format!("reject {}", reject.reason),
            _ => return,
        };
        sink.lock().unwrap().push(seen);
    });
    let other = bulkhead(1, None);
    let held = other
        .try_acquire_within(&global, &LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    // Refused globally: the tenant announces nothing.
    assert!(
        tenant
            .try_acquire_within(&global, &LlmRequest::new(), AcquireOptions::new())
            .is_err()
    );
    assert!(heard.lock().unwrap().is_empty());
    drop(held);
    let mine = tenant
        .try_acquire_within(&global, &LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    assert!(
        tenant
            .try_acquire_within(&global, &LlmRequest::new(), AcquireOptions::new())
            .is_err()
    );
    drop(mine);
    assert_eq!(
        *heard.lock().unwrap(),
        ["admit", "reject concurrency_limit"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_for_a_global_slot_holds_the_tenant_slot_uncounted_and_a_drop_gives_it_back() {
    let global = bulkhead(1, Some(10_000));
    let tenant = bulkhead(2, Some(10_000));
    let options = AcquireOptions::new().reservation(Reservation::new(10, 90).unwrap());
    let request = LlmRequest::new();
    let first = tenant
        .acquire_within(&global, &request, options)
        .await
        .unwrap();
    let mut waiting = Box::pin(tenant.acquire_within(&global, &request, options));
    let waker = futures::task::noop_waker();
    assert!(
        waiting
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending()
    );
    let t = tenant.stats();
    assert_eq!((t.admitted, t.in_flight), (1, 2));
    assert_eq!(t.token_budget.unwrap().in_flight_tokens, 200);
    assert_eq!(global.stats().pending, 1);
    drop(waiting);
    let t = tenant.stats();
    assert_eq!((t.admitted, t.rejected, t.in_flight), (1, 0, 1));
    assert_eq!(t.token_budget.unwrap().in_flight_tokens, 100);
    assert_eq!(global.stats().pending, 0);

    // A timeout at the global level: scoped global, nothing counted at the tenant.
    let short = options.timeout(Duration::from_millis(20));
    let err = tenant
        .acquire_within(&global, &request, short)
        .await
        .unwrap_err();
    assert_eq!(
        scope_and_reason(&err),
        (Some(Scope::Global), RejectReason::Timeout)
    );
    assert_eq!(tenant.stats().in_flight, 1);

    // Handed the global slot: admitted at both levels then.
    let next = tokio::spawn({
        let (tenant, global) = (tenant.clone(), global.clone());
        async move {
            let permit = tenant
                .acquire_within(&global, &LlmRequest::new(), options)
                .await
                .unwrap();
            permit.release(None);
        }
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    drop(first);
    next.await.unwrap();
    let (t, g) = (tenant.stats(), global.stats());
    assert_eq!((t.admitted, t.released, t.in_flight), (2, 2, 0));
    assert_eq!((g.admitted, g.released, g.in_flight), (2, 2, 0));
    assert_eq!(t.token_budget.unwrap().in_flight_tokens, 0);
}

/// Threads admit through four tenants (limit 3 each) within a global limit of 5, with and
/// without waiting: no level is ever over its limit, and every count adds up at the end.
#[test]
fn under_threads_no_level_is_over_its_limit_and_every_count_adds_up() {
    const TENANT_MAX: usize = 3;
    const GLOBAL_MAX: usize = 5;
    let global = bulkhead(GLOBAL_MAX, Some(4_000));
    let tenants: Vec<LlmBulkhead> = (0..4).map(|_| bulkhead(TENANT_MAX, Some(1_500))).collect();
    let running_global = AtomicUsize::new(0);
    let running: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
    let admitted: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
    let tenant_refused: Vec<AtomicU64> = (0..4).map(|_| AtomicU64::new(0)).collect();
    let global_refused = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for worker in 0..6u64 {
            let (global, tenants) = (&global, &tenants);
            let (running_global, running) = (&running_global, &running);
            let (admitted, tenant_refused, global_refused) =
                (&admitted, &tenant_refused, &global_refused);
            scope.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(worker);
                for _ in 0..4_000 {
                    let which = rng.usize(0..4);
                    let reservation = Reservation::new(rng.u64(1..200), rng.u64(1..400)).unwrap();
                    let options = AcquireOptions::new()
                        .reservation(reservation)
                        .timeout(Duration::from_millis(1));
                    let request = LlmRequest::new();
                    let result = if rng.bool() {
                        tenants[which].try_acquire_within(global, &request, options)
                    } else {
                        futures::executor::block_on(
                            tenants[which].acquire_within(global, &request, options),
                        )
                    };
                    match result {
                        Ok(mut permit) => {
                            admitted[which].fetch_add(1, Ordering::Relaxed);
                            let here = running[which].fetch_add(1, Ordering::SeqCst) + 1;
                            let all = running_global.fetch_add(1, Ordering::SeqCst) + 1;
                            assert!(here <= TENANT_MAX, "tenant over its limit: {here}");
                            assert!(all <= GLOBAL_MAX, "global over its limit: {all}");
                            if rng.bool() {
                                let usage = TokenUsage::new(rng.u64(0..300), rng.u64(0..500));
                                let _ = permit.report_usage(usage.unwrap());
                            }
                            std::thread::yield_now();
                            running[which].fetch_sub(1, Ordering::SeqCst);
                            running_global.fetch_sub(1, Ordering::SeqCst);
                            if rng.bool() {
                                permit.release(None);
                            }
                        }
                        Err(error) => match error.rejection().and_then(|r| r.scope()) {
                            Some(Scope::Tenant) => {
                                tenant_refused[which].fetch_add(1, Ordering::Relaxed);
                            }
                            Some(Scope::Global) => {
                                global_refused.fetch_add(1, Ordering::Relaxed);
                            }
                            other => panic!("an unscoped refusal: {other:?} {error}"),
                        },
                    }
                }
            });
        }
    });
    let mut total = 0;
    for (i, tenant) in tenants.iter().enumerate() {
        let stats = tenant.stats();
        assert_eq!(stats.admitted, admitted[i].load(Ordering::Relaxed));
        assert_eq!(stats.rejected, tenant_refused[i].load(Ordering::Relaxed));
        assert_eq!((stats.in_flight, stats.released), (0, stats.admitted));
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 0);
        total += stats.admitted;
    }
    let g = global.stats();
    assert_eq!(g.admitted, total);
    assert_eq!(g.rejected, global_refused.load(Ordering::Relaxed));
    assert_eq!((g.in_flight, g.pending, g.released), (0, 0, total));
    assert_eq!(g.token_budget.unwrap().in_flight_tokens, 0);
    assert!(total > 0 && g.rejected > 0);
}

#[cfg(feature = "serde")]
#[test]
fn a_refusal_body_names_its_scope() {
    let global = bulkhead(0, None);
    let tenant = bulkhead(4, None);
    let err = tenant
        .try_acquire_within(&global, &LlmRequest::new(), AcquireOptions::new())
        .unwrap_err();
    let body = async_bulkhead_llm::http::HttpRefusal::from(err).body();
    assert!(
        body.starts_with(
            r#"{"error":{"type":"rate_limit_error","code":"concurrency_limit","scope":"global","#
        ),
        "{body}"
    );
    let json = serde_json::to_value(err.rejection().unwrap()).unwrap();
    assert_eq!(json["scope"], "global");
}
