//! Reserved floors: while the classes' floors are reserved, a call within its class's floors
//! is admitted and released on its class's word alone, and the admission word counts every
//! class with a floor of calls at its floors at least. What users see must not change: the
//! decisions, their reasons and details, the stats, drain and close are those of the calls
//! and tokens in flight, whatever the word counts.

use async_bulkhead_llm::{
    LlmBulkhead, RejectReason, TokenBudget, TokenUsage, classes::AdmissionClasses,
    classes::ClassLimits, classes::ClassLimitsTable, rejection::Constraint,
};

use crate::support::{admit, class_stats, four_slots, in_class, refuse, tokens};

/// 10 slots, budget 200; `a` and `b` each with a floor of 1 call and 50 tokens, `c` with none:
/// the shared pool holds 8 slots and 100 tokens.
fn floors_and_a_borrower() -> LlmBulkhead {
    LlmBulkhead::builder("m", 10)
        .token_budget(TokenBudget::new(200))
        .admission_classes(
            AdmissionClasses::new("c")
                .class(
                    "a",
                    ClassLimits::new()
                        .protected_concurrent(1)
                        .protected_in_flight_tokens(50),
                )
                .class(
                    "b",
                    ClassLimits::new()
                        .protected_concurrent(1)
                        .protected_in_flight_tokens(50),
                )
                .class("c", ClassLimits::new()),
        )
        .build()
        .unwrap()
}

/// Whether a drain started now completes at once (nothing in flight, nobody waiting).
fn idle(bulkhead: &LlmBulkhead) -> bool {
    futures::executor::block_on(futures::future::poll_immediate(bulkhead.drain())).is_some()
}

#[test]
fn a_refusal_near_the_budget_is_judged_on_the_tokens_in_flight_not_on_reserved_floors() {
    let bulkhead = floors_and_a_borrower();
    // `c` borrows 90 of the 100 shared tokens; `b` holds 35 tokens within its floor of 50;
    // `a` is idle (its floor of 50 is reserved in the word, not in flight).
    let _c = admit(&bulkhead, tokens(in_class(&bulkhead, "c"), 40, 50));
    let b = tokens(in_class(&bulkhead, "b"), 10, 25);
    let first = admit(&bulkhead, b);
    assert_eq!(first.resources().borrowed_tokens, 0);
    // 30 more for `b` borrow 15 shared tokens (65 - 50): 105 of 100, refused by the floors
    // of the others. The budget itself has room: 125 in flight + 30 <= 200. Counting `a`'s
    // idle floor (50) would have refused it on the budget instead.
    let refused = refuse(&bulkhead, tokens(in_class(&bulkhead, "b"), 10, 20));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    let detail = refused.detail();
    assert_eq!(
        detail.constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    let budget = detail.token_budget.unwrap();
    assert_eq!((budget.in_flight_tokens, budget.available), (125, 75));
    assert_eq!(detail.in_flight, 2);
    // And a call the budget cannot hold is refused on the budget, with the same figures.
    let over = refuse(&bulkhead, tokens(in_class(&bulkhead, "a"), 40, 40));
    assert_eq!(over.reason(), RejectReason::BudgetLimit);
    assert_eq!(over.detail().constraint, Some(Constraint::Global));
    assert_eq!(over.detail().token_budget.unwrap().in_flight_tokens, 125);
}

#[test]
fn stats_drain_and_idleness_count_calls_in_flight_not_reserved_floors() {
    let bulkhead = four_slots();
    let premium = bulkhead.class("premium").unwrap();
    assert!(idle(&bulkhead));
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.released), (0, 0));
    let permit = admit(&bulkhead, in_class(&bulkhead, "premium"));
    assert!(!permit.resources().borrowed_concurrency);
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.admitted, stats.released), (1, 1, 0));
    assert_eq!(stats.admission_classes.unwrap().shared.in_flight, 0);
    assert_eq!(class_stats(&bulkhead, premium).in_flight, 1);
    assert!(!idle(&bulkhead));
    futures::executor::block_on(async {
        let mut drain = std::pin::pin!(bulkhead.drain());
        assert!(futures::poll!(drain.as_mut()).is_pending());
        drop(permit);
        drain.await;
    });
    assert!(idle(&bulkhead));
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.released), (0, 1));
    // After the drain the floors serve calls within them as before.
    let again = admit(&bulkhead, in_class(&bulkhead, "premium"));
    assert_eq!(bulkhead.stats().in_flight, 1);
    drop(again);
    assert!(idle(&bulkhead));
}

#[test]
fn close_refuses_calls_within_their_floors() {
    let bulkhead = four_slots();
    let held = admit(&bulkhead, in_class(&bulkhead, "premium"));
    assert!(bulkhead.close());
    let refused = refuse(&bulkhead, in_class(&bulkhead, "premium"));
    assert_eq!(refused.reason(), RejectReason::Shutdown);
    assert_eq!(refused.detail().in_flight, 1);
    drop(held);
    assert!(idle(&bulkhead));
    assert_eq!(bulkhead.stats().released, 1);
}

#[test]
fn floors_moved_under_calls_in_flight_keep_the_shared_figures_exact() {
    // Premium floor 2 of 4 slots: two premium calls within it, then the floor drops to 0:
    // both are borrowed now, the shared pool (4 - 1 = 3) holds them.
    let bulkhead = four_slots();
    let premium = in_class(&bulkhead, "premium");
    let first = admit(&bulkhead, premium);
    let second = admit(&bulkhead, premium);
    let shared = |b: &LlmBulkhead| b.stats().admission_classes.unwrap().shared.in_flight;
    assert_eq!(shared(&bulkhead), 0);
    let mut next = bulkhead.limits();
    next.revision += 1;
    next.admission_classes = Some(
        ClassLimitsTable::new()
            .with("premium", ClassLimits::new())
            .with("standard", ClassLimits::new().protected_concurrent(1)),
    );
    assert!(bulkhead.apply_limits(next).unwrap().is_applied());
    assert_eq!(shared(&bulkhead), 2);
    assert_eq!(bulkhead.stats().in_flight, 2);
    // One more premium call borrows the last shared slot; the next is refused by standard's
    // floor, with the exact figures.
    let third = admit(&bulkhead, premium);
    assert!(third.resources().borrowed_concurrency);
    let refused = refuse(&bulkhead, premium);
    assert_eq!(
        refused.detail().constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    assert_eq!(refused.detail().in_flight, 3);
    drop((first, second, third));
    assert_eq!(shared(&bulkhead), 0);
    assert!(idle(&bulkhead));
    // Standard's floor still admits within it.
    let standard = admit(&bulkhead, in_class(&bulkhead, "standard"));
    assert!(!standard.resources().borrowed_concurrency);
}

/// A token floor lowered under a call in flight: the call's class is beyond its floors now,
/// though its count of calls is within them, so its release gives back what it now borrows
/// (under the class's lock, not on the class word alone). A floor raised again makes the next
/// call's release one on the class word again.
#[test]
fn a_token_floor_lowered_under_a_call_in_flight_gets_its_borrowed_tokens_back() {
    let bulkhead = floors_and_a_borrower();
    let a = in_class(&bulkhead, "a");
    let shared_tokens = |b: &LlmBulkhead| {
        b.stats()
            .admission_classes
            .unwrap()
            .shared
            .token_budget
            .unwrap()
            .in_flight_tokens
    };
    let with_a_token_floor = |b: &LlmBulkhead, revision: u64, floor: u64| {
        let mut next = b.limits();
        next.revision = revision;
        let a_floors = ClassLimits::new()
            .protected_concurrent(1)
            .protected_in_flight_tokens(floor);
        let b_floors = ClassLimits::new()
            .protected_concurrent(1)
            .protected_in_flight_tokens(50);
        next.admission_classes = Some(
            ClassLimitsTable::new()
                .with("a", a_floors)
                .with("b", b_floors)
                .with("c", ClassLimits::new()),
        );
        assert!(b.apply_limits(next).unwrap().is_applied());
    };
    let call = admit(&bulkhead, tokens(a, 10, 10));
    assert_eq!(call.resources().borrowed_tokens, 0);
    assert_eq!(shared_tokens(&bulkhead), 0);
    with_a_token_floor(&bulkhead, 1, 5);
    assert_eq!(shared_tokens(&bulkhead), 15, "20 held against a floor of 5");
    drop(call);
    assert_eq!(shared_tokens(&bulkhead), 0, "given back at the release");
    assert_eq!(class_stats(&bulkhead, a.class.unwrap()).in_flight_tokens, 0);
    assert!(idle(&bulkhead));
    // Within the lowered floor, and then within the floor raised again.
    drop(admit(&bulkhead, tokens(a, 2, 3)));
    with_a_token_floor(&bulkhead, 2, 50);
    let call = admit(&bulkhead, tokens(a, 10, 10));
    assert_eq!(call.resources().borrowed_tokens, 0);
    drop(call);
    assert_eq!(shared_tokens(&bulkhead), 0);
    assert!(idle(&bulkhead));
    let stats = class_stats(&bulkhead, a.class.unwrap());
    assert_eq!((stats.admitted, stats.released), (3, 3));
}

#[test]
fn a_usage_report_beyond_the_shared_tokens_keeps_every_figure_exact() {
    let bulkhead = floors_and_a_borrower();
    // `a` reserves 40 within its floor, then reports 190 tokens used: 140 beyond its floor,
    // more than the shared pool's 100 (a report is never refused for the budget).
    let mut permit = admit(&bulkhead, tokens(in_class(&bulkhead, "a"), 20, 20));
    permit
        .report_usage(TokenUsage::new(150, 40).unwrap())
        .unwrap();
    let stats = bulkhead.stats();
    assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 190);
    let classes = stats.admission_classes.unwrap();
    assert_eq!(classes.shared.token_budget.unwrap().in_flight_tokens, 140);
    // Nothing else fits the shared pool now; `b` still has its own floor.
    let refused = refuse(&bulkhead, tokens(in_class(&bulkhead, "c"), 1, 1));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    assert_eq!(refused.detail().token_budget.unwrap().in_flight_tokens, 190);
    let b = admit(&bulkhead, tokens(in_class(&bulkhead, "b"), 5, 5));
    assert_eq!(b.resources().borrowed_tokens, 0);
    drop((permit, b));
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.token_budget.unwrap().in_flight_tokens
        ),
        (0, 0)
    );
    assert_eq!(
        stats
            .admission_classes
            .unwrap()
            .shared
            .token_budget
            .unwrap()
            .in_flight_tokens,
        0
    );
    // Calls within their floors are admitted as before.
    let within = admit(&bulkhead, tokens(in_class(&bulkhead, "a"), 10, 10));
    assert_eq!(within.resources().borrowed_tokens, 0);
    assert_eq!(bulkhead.stats().token_budget.unwrap().in_flight_tokens, 20);
}

/// Every door admits a call within its class's floors the way `try_acquire` does (the class
/// lane of `try_acquire_owned` and of the acquire futures' first poll): nothing borrowed,
/// booked to its class, returned exactly; a second call of the class, beyond its floor,
/// borrows on the general path; a call naming no class lands in the default one.
#[test]
fn every_door_admits_a_call_within_its_floors_alike() {
    use async_bulkhead_llm::{AcquireOptions, LlmRequest, OwnedPermit, admission::Admission};
    use futures::executor::block_on;

    type Door = fn(&LlmBulkhead, AcquireOptions) -> OwnedPermit;
    let doors: [(&str, Door); 2] = [
        ("try_acquire_owned", |b, o| {
            b.try_acquire_owned(&LlmRequest::new(), o).unwrap()
        }),
        ("acquire_owned", |b, o| {
            block_on(b.acquire_owned(&LlmRequest::new(), o)).unwrap()
        }),
    ];
    for (door, admit_with) in doors {
        let bulkhead = floors_and_a_borrower();
        let a = bulkhead.class("a").unwrap();
        let within = |admission: &Admission| {
            assert_eq!(admission.class(), Some(a), "{door}");
            assert!(!admission.resources().borrowed_concurrency, "{door}");
            assert_eq!(admission.resources().borrowed_tokens, 0, "{door}");
            assert_eq!(
                (
                    admission.reservation().map(|r| r.reserved()),
                    admission.held_tokens()
                ),
                (Some(30), 30),
                "{door}"
            );
        };
        let call = || tokens(in_class(&bulkhead, "a"), 10, 20);
        let first = admit_with(&bulkhead, call());
        within(&first);
        // Awaited while `first` holds `a`'s floor: beyond it, `a` borrows a shared slot.
        let second = block_on(bulkhead.acquire(&LlmRequest::new(), call())).unwrap();
        assert!(second.resources().borrowed_concurrency, "{door}");
        let stats = class_stats(&bulkhead, a);
        assert_eq!(
            (stats.in_flight, stats.admitted, stats.in_flight_tokens),
            (2, 2, 60),
            "{door}"
        );
        drop((first, second));
        // Awaited alone, within the floor: the class lane of `acquire`'s first poll.
        let third = block_on(bulkhead.acquire(&LlmRequest::new(), call())).unwrap();
        within(&third);
        drop(third);
        // No class named: the default class (`c`), admitted on the general path.
        let plain =
            block_on(bulkhead.acquire(&LlmRequest::new(), tokens(AcquireOptions::new(), 1, 1)))
                .unwrap();
        assert_eq!(plain.class(), Some(bulkhead.class("c").unwrap()), "{door}");
        drop(plain);
        let stats = class_stats(&bulkhead, a);
        assert_eq!(
            (
                stats.in_flight,
                stats.admitted,
                stats.released,
                stats.in_flight_tokens
            ),
            (0, 3, 3, 0),
            "{door}"
        );
        assert_eq!(stats.total_reserved, 90, "{door}");
        assert!(idle(&bulkhead), "{door}");
    }
}

#[test]
fn the_try_doors_admit_named_and_default_class_calls_alike_heard_or_not() {
    use std::num::NonZeroU32;

    use async_bulkhead_llm::{AcquireOptions, LlmRequest, events::EventKind};

    // A call that names its class takes the class door (`try_acquire_classed`); one of the
    // default class, which names none, the general path's class lane; with a sampled
    // listener, the timed door first (one call in four sampled, decided on the general path).
    for listened in [false, true] {
        let bulkhead = floors_and_a_borrower();
        let _listener = listened.then(|| {
            bulkhead.on_events_sampled([EventKind::Admit], NonZeroU32::new(4).unwrap(), |_| {})
        });
        let (a, c) = (bulkhead.class("a").unwrap(), bulkhead.class("c").unwrap());
        let call = || tokens(in_class(&bulkhead, "a"), 10, 20);
        let first = bulkhead.try_acquire(&LlmRequest::new(), call()).unwrap();
        assert_eq!(first.class(), Some(a), "{listened}");
        assert!(!first.resources().borrowed_concurrency, "{listened}");
        assert_eq!(first.held_tokens(), 30, "{listened}");
        drop(first);
        let second = bulkhead
            .try_acquire_owned(&LlmRequest::new(), call())
            .unwrap();
        assert!(!second.resources().borrowed_concurrency, "{listened}");
        // `a` at its floor: the next call borrows a shared slot.
        let third = bulkhead.try_acquire(&LlmRequest::new(), call()).unwrap();
        assert!(third.resources().borrowed_concurrency, "{listened}");
        let plain = || tokens(AcquireOptions::new(), 1, 1);
        let fourth = bulkhead.try_acquire(&LlmRequest::new(), plain()).unwrap();
        let fifth = bulkhead
            .try_acquire_owned(&LlmRequest::new(), plain())
            .unwrap();
        assert_eq!(
            (fourth.class(), fifth.class()),
            (Some(c), Some(c)),
            "{listened}"
        );
        let stats = class_stats(&bulkhead, a);
        assert_eq!(
            (stats.in_flight, stats.admitted, stats.in_flight_tokens),
            (2, 3, 60),
            "{listened}"
        );
        assert_eq!(class_stats(&bulkhead, c).in_flight_tokens, 4, "{listened}");
        drop((second, third, fourth, fifth));
        let stats = class_stats(&bulkhead, a);
        assert_eq!(
            (stats.in_flight, stats.released, stats.total_reserved),
            (0, 3, 90),
            "{listened}"
        );
        assert!(idle(&bulkhead), "{listened}");
    }
}

#[test]
fn a_call_of_the_default_class_is_admitted_within_its_floors_by_every_door() {
    use async_bulkhead_llm::{AcquireOptions, LlmRequest, OwnedPermit, Permit};
    use futures::executor::block_on;

    /// A permit of either door kind, held until dropped.
    #[allow(dead_code)]
    enum Held<'a> {
        Borrowed(Permit<'a>),
        Owned(OwnedPermit),
    }

    // `a` the default class, with a floor of 2 calls and 100 tokens.
    let build = || {
        LlmBulkhead::builder("m", 10)
            .token_budget(TokenBudget::new(200))
            .admission_classes(
                AdmissionClasses::new("a")
                    .class(
                        "a",
                        ClassLimits::new()
                            .protected_concurrent(2)
                            .protected_in_flight_tokens(100),
                    )
                    .class("b", ClassLimits::new()),
            )
            .build()
            .unwrap()
    };
    let call = || tokens(AcquireOptions::new(), 10, 20);
    let request = LlmRequest::new();
    for door in [
        "try_acquire",
        "try_acquire_owned",
        "acquire",
        "acquire_owned",
    ] {
        let bulkhead = build();
        let a = bulkhead.class("a").unwrap();
        // Two calls within the floor, the third beyond it (borrowing a shared slot).
        let mut borrowed = Vec::new();
        let mut held = Vec::new();
        for _ in 0..3 {
            let (class, resources, permit) = match door {
                "try_acquire" => {
                    let p = bulkhead.try_acquire(&request, call()).unwrap();
                    (p.class(), p.resources(), Held::Borrowed(p))
                }
                "try_acquire_owned" => {
                    let p = bulkhead.try_acquire_owned(&request, call()).unwrap();
                    (p.class(), p.resources(), Held::Owned(p))
                }
                "acquire" => {
                    let p = block_on(bulkhead.acquire(&request, call())).unwrap();
                    (p.class(), p.resources(), Held::Borrowed(p))
                }
                _ => {
                    let p = block_on(bulkhead.acquire_owned(&request, call())).unwrap();
                    (p.class(), p.resources(), Held::Owned(p))
                }
            };
            assert_eq!(class, Some(a), "{door}");
            borrowed.push(resources.borrowed_concurrency);
            held.push(permit);
        }
        assert_eq!(borrowed, [false, false, true], "{door}");
        let stats = class_stats(&bulkhead, a);
        assert_eq!((stats.in_flight, stats.in_flight_tokens), (3, 90), "{door}");
        drop(held);
        assert_eq!(class_stats(&bulkhead, a).in_flight_tokens, 0, "{door}");
        assert!(idle(&bulkhead), "{door}");
        let stats = class_stats(&bulkhead, a);
        assert_eq!(
            (stats.admitted, stats.released, stats.total_reserved),
            (3, 3, 90),
            "{door}"
        );
    }
}
