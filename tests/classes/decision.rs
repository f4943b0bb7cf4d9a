//! The class decision: ceilings, floors and the shared pool, in the judging order, with the
//! refusal detail (upstream's worked examples number for number).

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, TokenBudget, admission::Verdict,
    classes::AdmissionClasses, classes::ClassLimits, classes::Resources, rejection::Constraint,
    rejection::SharedPool,
};

use crate::support::{admit, class_stats, four_slots, in_class, refuse, token_floors, tokens};

#[test]
fn a_full_shared_pool_refuses_a_borrowing_premium_call_with_protection_detail() {
    // 4 slots, floors premium 2 / standard 1: the shared pool holds 1 slot.
    let b = four_slots();
    let premium = in_class(&b, "premium");
    let held: Vec<_> = (0..3).map(|_| admit(&b, premium)).collect();
    assert_eq!(
        held.iter()
            .map(|p| p.resources().borrowed_concurrency)
            .collect::<Vec<_>>(),
        [false, false, true]
    );
    let r = refuse(&b, premium);
    assert_eq!(r.reason(), RejectReason::ConcurrencyLimit);
    let d = r.detail();
    assert_eq!(d.constraint, Some(Constraint::AdmissionClassProtection));
    assert_eq!(
        d.shared_capacity().unwrap().concurrency,
        SharedPool::compute(1, 1, 1)
    );
    assert_eq!(d.shared_capacity().unwrap().token_budget, None);
    let class = d.admission_class().unwrap();
    assert_eq!(class.class.id(), "premium");
    assert_eq!(
        (
            class.in_flight,
            class.protected_concurrent,
            class.protected_concurrent_in_use,
            class.borrowed_concurrent,
            class.available_protected_concurrent,
            class.max_concurrent,
            class.available_concurrent,
        ),
        (3, 2, 2, 1, 0, None, None)
    );
    assert_eq!(class.token_budget, None);
    // The global picture is the usual one: 3 of 4 slots held.
    assert_eq!((d.in_flight, d.max_concurrent), (3, 4));
    // Standard still has its floor: the idle protected slot is never lent, but it is its own.
    let standard = admit(&b, in_class(&b, "standard"));
    assert!(!standard.resources().borrowed_concurrency);
    // Counted against premium only.
    let p = class_stats(&b, b.class("premium").unwrap());
    assert_eq!((p.rejected, p.rejected_by_reason.concurrency_limit), (1, 1));
    assert_eq!(class_stats(&b, b.class("standard").unwrap()).rejected, 0);
    assert_eq!(b.stats().rejected, 1);
}

#[test]
fn a_full_shared_token_pool_refuses_with_budget_limit_and_token_detail() {
    // Budget 2000, token floors premium 400 / standard 800: the shared pool holds 800 tokens.
    let b = token_floors();
    let premium = tokens(in_class(&b, "premium"), 100, 300);
    let held: Vec<_> = (0..3).map(|_| admit(&b, premium)).collect();
    assert_eq!(
        held.iter()
            .map(|p| p.resources().borrowed_tokens)
            .collect::<Vec<_>>(),
        [0, 400, 400]
    );
    // Every premium slot is borrowed: premium has no concurrency floor.
    assert!(held.iter().all(|p| p.resources().borrowed_concurrency));
    let r = refuse(&b, premium);
    assert_eq!(r.reason(), RejectReason::BudgetLimit);
    let d = r.detail();
    assert_eq!(d.constraint, Some(Constraint::AdmissionClassProtection));
    assert_eq!(
        d.shared_capacity().unwrap().token_budget,
        Some(SharedPool::compute(800, 800, 400))
    );
    let t = d.admission_class().unwrap().token_budget.unwrap();
    assert_eq!(
        (
            t.in_flight_tokens,
            t.protected_in_flight_tokens,
            t.protected_tokens_in_use,
            t.borrowed_in_flight_tokens,
            t.available_protected_tokens,
            t.max_in_flight_tokens,
            t.available,
            t.requested,
        ),
        (1200, 400, 400, 800, 0, None, None, 400)
    );
    // The global budget had room (1200 of 2000): only the floor of standard refused it.
    assert_eq!(d.token_budget.unwrap().available, 800);
    // Standard's 800 protected tokens are still there for it.
    let standard = admit(&b, tokens(in_class(&b, "standard"), 400, 400));
    assert_eq!(standard.resources().borrowed_tokens, 0);
    let shared = b.stats().admission_classes.unwrap().shared;
    assert_eq!((shared.max_concurrent, shared.in_flight), (100, 4));
    let shared_tokens = shared.token_budget.unwrap();
    assert_eq!(
        (
            shared_tokens.budget,
            shared_tokens.in_flight_tokens,
            shared_tokens.available
        ),
        (800, 800, 0)
    );
}

#[test]
fn calls_within_their_floor_skip_protection_but_not_global_concurrency() {
    // Floors premium 1 / standard 1 on 2 slots: no shared pool at all.
    let b = LlmBulkhead::builder("m", 2)
        .admission_classes(
            AdmissionClasses::new("standard")
                .class("premium", ClassLimits::new().protected_concurrent(1))
                .class("standard", ClassLimits::new().protected_concurrent(1)),
        )
        .build()
        .unwrap();
    let premium = in_class(&b, "premium");
    let first = admit(&b, premium);
    assert_eq!(first.resources(), Resources::NONE);
    // A second premium call would borrow from a pool of 0.
    let r = refuse(&b, premium);
    assert_eq!(
        (r.reason(), r.detail().constraint),
        (
            RejectReason::ConcurrencyLimit,
            Some(Constraint::AdmissionClassProtection)
        )
    );
    let standard = admit(&b, in_class(&b, "standard"));
    // Both floors in use, the bulkhead full: a standard call beyond its floor is refused by
    // protection (it would borrow), checked before the global slots.
    let r = refuse(&b, in_class(&b, "standard"));
    assert_eq!(
        r.detail().constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    drop((first, standard));
    assert_eq!(b.stats().in_flight, 0);
}

#[test]
fn a_floor_raised_over_borrowed_slots_is_not_a_guaranteed_slot() {
    // Premium borrows every slot; then its floor moves to standard. Standard is within its new
    // floor, so protection does not apply, but the slots are all held: global refusal.
    let b = LlmBulkhead::builder("m", 2)
        .admission_classes(
            AdmissionClasses::new("standard")
                .class("premium", ClassLimits::new())
                .class("standard", ClassLimits::new()),
        )
        .build()
        .unwrap();
    let held = [
        admit(&b, in_class(&b, "premium")),
        admit(&b, in_class(&b, "premium")),
    ];
    let mut next = b.limits();
    next.revision += 1;
    next.admission_classes = Some(
        async_bulkhead_llm::classes::ClassLimitsTable::new()
            .with("premium", ClassLimits::new())
            .with("standard", ClassLimits::new().protected_concurrent(2)),
    );
    b.apply_limits(next).unwrap();
    let r = refuse(&b, in_class(&b, "standard"));
    assert_eq!(
        (r.reason(), r.detail().constraint),
        (RejectReason::ConcurrencyLimit, Some(Constraint::Global))
    );
    drop(held);
    // Attrition done: standard's floor is its own now, premium (no floor) borrows nothing.
    let s = admit(&b, in_class(&b, "standard"));
    assert!(!s.resources().borrowed_concurrency);
    let r = refuse(&b, in_class(&b, "premium"));
    assert_eq!(
        r.detail().constraint,
        Some(Constraint::AdmissionClassProtection)
    );
}

#[test]
fn class_ceilings_come_before_protection_and_tokens_before_slots() {
    let b = LlmBulkhead::builder("m", 10)
        .token_budget(TokenBudget::new(10_000))
        .admission_classes(
            AdmissionClasses::new("batch")
                .class("premium", ClassLimits::new().protected_concurrent(5))
                .class(
                    "batch",
                    ClassLimits::new()
                        .max_concurrent(2)
                        .max_in_flight_tokens(1000),
                ),
        )
        .build()
        .unwrap();
    let batch = in_class(&b, "batch");
    let a = admit(&b, tokens(batch, 100, 300));
    let c = admit(&b, tokens(batch, 100, 300));
    // Both ceilings would refuse the third: the token ceiling is judged first.
    let r = refuse(&b, tokens(batch, 100, 300));
    assert_eq!(
        (r.reason(), r.detail().constraint),
        (RejectReason::BudgetLimit, Some(Constraint::AdmissionClass))
    );
    let t = r.detail().admission_class().unwrap().token_budget.unwrap();
    assert_eq!(
        (
            t.in_flight_tokens,
            t.max_in_flight_tokens,
            t.available,
            t.requested
        ),
        (800, Some(1000), Some(200), 400)
    );
    // Within the token ceiling, the concurrency ceiling refuses.
    let r = refuse(&b, tokens(batch, 50, 50));
    assert_eq!(
        (r.reason(), r.detail().constraint),
        (
            RejectReason::ConcurrencyLimit,
            Some(Constraint::AdmissionClass)
        )
    );
    let class = r.detail().admission_class().unwrap();
    assert_eq!(
        (class.max_concurrent, class.available_concurrent),
        (Some(2), Some(0))
    );
    // The global budget refuses before any class check.
    let r = refuse(&b, tokens(in_class(&b, "premium"), 9000, 1000));
    assert_eq!(
        (r.reason(), r.detail().constraint),
        (RejectReason::BudgetLimit, Some(Constraint::Global))
    );
    drop((a, c));
}

#[test]
fn shutdown_refuses_first_and_names_no_constraint() {
    let b = four_slots();
    b.close();
    let r = refuse(&b, in_class(&b, "premium"));
    assert_eq!(
        (r.reason(), r.detail().constraint),
        (RejectReason::Shutdown, None)
    );
    assert_eq!(r.detail().admission_class().unwrap().class.id(), "premium");
}

#[test]
fn would_admit_judges_like_an_admission_and_counts_nothing() {
    let b = four_slots();
    let premium = in_class(&b, "premium");
    let _held: Vec<_> = (0..3).map(|_| admit(&b, premium)).collect();
    let (verdict, detail) = b
        .would_admit_with_detail(&LlmRequest::new(), premium)
        .unwrap();
    assert_eq!(verdict, Verdict::Reject(RejectReason::ConcurrencyLimit));
    assert_eq!(
        detail.constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    assert_eq!(
        b.would_admit(&LlmRequest::new(), in_class(&b, "standard"))
            .unwrap(),
        Verdict::Admit
    );
    // The default class is standard.
    assert_eq!(
        b.would_admit(&LlmRequest::new(), AcquireOptions::new())
            .unwrap(),
        Verdict::Admit
    );
    let stats = b.stats();
    assert_eq!((stats.rejected, stats.admitted), (0, 3));
}

#[test]
fn a_class_with_no_floor_borrows_every_slot_and_every_token() {
    let b = LlmBulkhead::builder("m", 3)
        .token_budget(TokenBudget::new(1000))
        .admission_classes(AdmissionClasses::new("only").class("only", ClassLimits::new()))
        .build()
        .unwrap();
    let p = admit(&b, tokens(AcquireOptions::new(), 10, 90));
    assert_eq!(
        (
            p.resources().borrowed_concurrency,
            p.resources().borrowed_tokens
        ),
        (true, 100)
    );
    let s = class_stats(&b, b.default_class().unwrap());
    assert_eq!(
        (
            s.total_borrowed_admissions,
            s.total_borrowed_tokens_reserved,
            s.borrowed_concurrent
        ),
        (1, 100, 1)
    );
    // No floor anywhere: protection never applies, the shared pool is everything.
    let shared = b.stats().admission_classes.unwrap().shared;
    assert_eq!(
        (
            shared.max_concurrent,
            shared.in_flight,
            shared.available_concurrent
        ),
        (3, 1, 2)
    );
}
