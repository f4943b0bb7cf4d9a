//! Limits with classes (`limits`, `apply_limits`, `set_budget`): validation of the class part,
//! shrink by attrition, and the class fields of events and stats.

use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    Limits, LlmBulkhead, RejectReason, TokenBudget, TokenUsage, classes::AdmissionClasses,
    classes::ClassField, classes::ClassLimits, classes::ClassLimitsError,
    classes::ClassLimitsTable, events::Event, limits::ApplyOutcome, limits::LimitsError,
    rejection::Constraint,
};

use crate::support::{admit, class_stats, in_class, refuse, tokens};

fn tiers() -> LlmBulkhead {
    LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(1000))
        .admission_classes(
            AdmissionClasses::new("standard")
                .class(
                    "premium",
                    ClassLimits::new().protected_concurrent(1).max_concurrent(3),
                )
                .class("standard", ClassLimits::new()),
        )
        .build()
        .unwrap()
}

fn with_classes(b: &LlmBulkhead, table: Option<ClassLimitsTable>) -> Limits {
    let mut next = b.limits();
    next.revision += 1;
    next.admission_classes = table;
    next
}

#[test]
fn limits_carry_the_classes_in_order_without_zero_floors() {
    let b = LlmBulkhead::builder("m", 4)
        .admission_classes(
            AdmissionClasses::new("b")
                .class(
                    "b",
                    ClassLimits::new().protected_concurrent(0).max_concurrent(2),
                )
                .class("a", ClassLimits::new().protected_concurrent(1)),
        )
        .build()
        .unwrap();
    let limits = b.limits();
    assert_eq!(
        limits.admission_classes,
        Some(
            ClassLimitsTable::new()
                .with("b", ClassLimits::new().max_concurrent(2))
                .with("a", ClassLimits::new().protected_concurrent(1))
        )
    );
    assert_eq!(b.stats().limits, limits);
}

#[test]
fn the_class_part_of_new_limits_is_validated_and_a_failure_changes_nothing() {
    let b = tiers();
    let before = b.limits();
    let ok = ClassLimits::new();
    let cases: Vec<(Option<ClassLimitsTable>, LimitsError)> = vec![
        (None, LimitsError::AdmissionClassesRequired),
        (
            Some(ClassLimitsTable::new().with("premium", ok)),
            LimitsError::ClassIdsMismatch,
        ),
        (
            Some(ClassLimitsTable::new().with("premium", ok).with("gold", ok)),
            LimitsError::ClassIdsMismatch,
        ),
        (
            Some(
                ClassLimitsTable::new()
                    .with("premium", ok)
                    .with("standard", ok)
                    .with("x", ok),
            ),
            LimitsError::ClassIdsMismatch,
        ),
        (
            Some(
                ClassLimitsTable::new()
                    .with(
                        "premium",
                        ClassLimits::new().protected_concurrent(2).max_concurrent(1),
                    )
                    .with("standard", ok),
            ),
            LimitsError::Class(ClassLimitsError::ProtectedAboveMax {
                class: "premium".into(),
                field: ClassField::ProtectedConcurrent,
                protected: 2,
                max: 1,
            }),
        ),
        (
            Some(
                ClassLimitsTable::new()
                    .with("premium", ClassLimits::new().protected_concurrent(3))
                    .with("standard", ClassLimits::new().protected_concurrent(2)),
            ),
            LimitsError::ProtectedConcurrentSumTooLarge {
                sum: 5,
                max_concurrent: 4,
            },
        ),
        (
            Some(
                ClassLimitsTable::new()
                    .with(
                        "premium",
                        ClassLimits::new().protected_in_flight_tokens(600),
                    )
                    .with(
                        "standard",
                        ClassLimits::new().protected_in_flight_tokens(500),
                    ),
            ),
            LimitsError::ProtectedTokensSumTooLarge {
                sum: 1100,
                budget: 1000,
            },
        ),
    ];
    for (table, expected) in cases {
        assert_eq!(b.apply_limits(with_classes(&b, table)), Err(expected));
        assert_eq!(b.limits(), before);
    }
    // The order of keys may differ: the construction order is kept.
    let reordered = ClassLimitsTable::new()
        .with("standard", ClassLimits::new().protected_concurrent(1))
        .with("premium", ok);
    b.apply_limits(with_classes(&b, Some(reordered))).unwrap();
    let ids: Vec<_> = b
        .limits()
        .admission_classes
        .unwrap()
        .iter()
        .map(|(id, _)| id.to_owned())
        .collect();
    assert_eq!(ids, ["premium", "standard"]);
    // Floor sums are checked against the new limits, not the old ones.
    let mut next = with_classes(
        &b,
        Some(
            ClassLimitsTable::new()
                .with("premium", ClassLimits::new().protected_concurrent(3))
                .with("standard", ClassLimits::new().protected_concurrent(3)),
        ),
    );
    assert!(matches!(
        b.apply_limits(next.clone()),
        Err(LimitsError::ProtectedConcurrentSumTooLarge { .. })
    ));
    next.max_concurrent = 6;
    assert!(b.apply_limits(next).unwrap().is_applied());
    // A budget below the token floors is refused by set_budget too.
    let mut floors = with_classes(
        &b,
        Some(
            ClassLimitsTable::new()
                .with(
                    "premium",
                    ClassLimits::new().protected_in_flight_tokens(300),
                )
                .with("standard", ok),
        ),
    );
    floors.max_concurrent = 4;
    b.apply_limits(floors).unwrap();
    let before = b.limits();
    assert_eq!(
        b.set_budget(299),
        Err(LimitsError::ProtectedTokensSumTooLarge {
            sum: 300,
            budget: 299
        })
    );
    assert_eq!(b.limits(), before);
    assert_eq!(b.set_budget(300).unwrap().token_budget.unwrap().budget, 300);
    // A bulkhead without classes refuses a class part.
    let plain = LlmBulkhead::builder("m", 1).build().unwrap();
    let mut next = plain.limits();
    next.revision = 1;
    next.admission_classes = Some(ClassLimitsTable::new().with("a", ok));
    assert_eq!(
        plain.apply_limits(next),
        Err(LimitsError::AdmissionClassesNotConfigured)
    );
}

#[test]
fn class_ceilings_shrink_by_attrition() {
    // Upstream's example: premium set to {max_concurrent 0, max_in_flight_tokens 0} while a
    // premium call is in flight: applied; it stays in flight; the next premium call is
    // refused `budget_limit` (the token ceiling is judged before the concurrency ceiling).
    let b = tiers();
    let premium = tokens(in_class(&b, "premium"), 10, 10);
    let held = admit(&b, premium);
    let next = with_classes(
        &b,
        Some(
            ClassLimitsTable::new()
                .with(
                    "premium",
                    ClassLimits::new().max_concurrent(0).max_in_flight_tokens(0),
                )
                .with("standard", ClassLimits::new()),
        ),
    );
    assert!(matches!(
        b.apply_limits(next).unwrap(),
        ApplyOutcome::Applied { .. }
    ));
    let p = class_stats(&b, b.class("premium").unwrap());
    assert_eq!((p.in_flight, p.in_flight_tokens), (1, 20));
    let r = refuse(&b, premium);
    assert_eq!(
        (r.reason(), r.detail().constraint),
        (RejectReason::BudgetLimit, Some(Constraint::AdmissionClass))
    );
    held.release(Some(TokenUsage::new(10, 5).unwrap()));
    let p = class_stats(&b, b.class("premium").unwrap());
    assert_eq!(
        (p.in_flight, p.released, p.total_consumed, p.total_refunded),
        (0, 1, 15, 5)
    );
}

#[test]
fn events_carry_the_class() {
    let b = tiers();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let _sub = b.on(move |e| {
        let class = match e {
            Event::Admit(e) => e.class,
            Event::Reject(e) => e.class,
            Event::Usage(e) => e.class,
            Event::Release(e) => e.class,
            _ => return,
        };
        sink.lock()
            .unwrap()
            .push((e.kind().as_str(), class.map(|c| c.id())));
    });
    let premium = tokens(in_class(&b, "premium"), 10, 10);
    let mut p = admit(&b, premium);
    p.report_usage(TokenUsage::new(5, 1).unwrap()).unwrap();
    drop(p);
    let _held: Vec<_> = (0..3).map(|_| admit(&b, premium)).collect();
    refuse(&b, premium); // the ceiling of 3
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen[..4],
        [
            ("admit", Some("premium")),
            ("usage", Some("premium")),
            ("release", Some("premium")),
            ("admit", Some("premium")),
        ]
    );
    assert_eq!(seen.last(), Some(&("reject", Some("premium"))));
}

#[test]
fn stats_report_every_class_in_order() {
    let b = tiers();
    let _a = admit(&b, tokens(in_class(&b, "premium"), 10, 10));
    let _c = admit(&b, tokens(in_class(&b, "standard"), 30, 30));
    let classes = b.stats().admission_classes.unwrap();
    assert_eq!(classes.default_class.id(), "standard");
    assert_eq!(classes.shared.max_concurrent, 3);
    assert_eq!(classes.shared.in_flight, 1); // standard has no floor
    let [p, s] = &classes.classes[..] else {
        panic!()
    };
    assert_eq!(
        (p.class.id(), p.in_flight, p.in_flight_tokens, p.admitted),
        ("premium", 1, 20, 1)
    );
    assert_eq!(
        (s.class.id(), s.in_flight, s.in_flight_tokens, s.admitted),
        ("standard", 1, 60, 1)
    );
    assert_eq!(
        p.limits,
        ClassLimits::new().protected_concurrent(1).max_concurrent(3)
    );
    #[cfg(feature = "serde")]
    {
        let json = serde_json::to_value(b.stats()).unwrap();
        let classes = &json["admission_classes"];
        assert_eq!(classes["default_class"], "standard");
        assert_eq!(classes["classes"][0]["class"], "premium");
        assert_eq!(classes["classes"][1]["in_flight_tokens"], 60);
    }
}

#[test]
fn every_class_value_too_large_for_the_engine_is_refused_in_config_and_limits() {
    use async_bulkhead_llm::{builder::ConfigError, limits::MAX_BUDGET, limits::MAX_CONCURRENT};
    let fields = [
        (
            ClassField::ProtectedConcurrent,
            ClassLimits::new().protected_concurrent(MAX_CONCURRENT + 1),
            u64::from(MAX_CONCURRENT),
        ),
        (
            ClassField::MaxConcurrent,
            ClassLimits::new().max_concurrent(MAX_CONCURRENT + 1),
            u64::from(MAX_CONCURRENT),
        ),
        (
            ClassField::ProtectedInFlightTokens,
            ClassLimits::new().protected_in_flight_tokens(MAX_BUDGET + 1),
            MAX_BUDGET,
        ),
        (
            ClassField::MaxInFlightTokens,
            ClassLimits::new().max_in_flight_tokens(MAX_BUDGET + 1),
            MAX_BUDGET,
        ),
    ];
    let b = tiers();
    for (field, limits, max) in fields {
        let expected = ClassLimitsError::TooLarge {
            class: "premium".into(),
            field,
            value: max + 1,
            max,
        };
        let built = LlmBulkhead::builder("m", 4)
            .token_budget(TokenBudget::new(1000))
            .admission_classes(AdmissionClasses::new("premium").class("premium", limits))
            .build();
        assert_eq!(built.unwrap_err(), ConfigError::Class(expected.clone()));
        let before = b.limits();
        let next = with_classes(
            &b,
            Some(
                ClassLimitsTable::new()
                    .with("premium", limits)
                    .with("standard", ClassLimits::new()),
            ),
        );
        assert_eq!(b.apply_limits(next), Err(LimitsError::Class(expected)));
        assert_eq!(b.limits(), before);
    }
    // Token limits on a bulkhead without a budget, through apply_limits too.
    let plain = LlmBulkhead::builder("m", 4)
        .admission_classes(AdmissionClasses::new("a").class("a", ClassLimits::new()))
        .build()
        .unwrap();
    let next = with_classes(
        &plain,
        Some(ClassLimitsTable::new().with("a", ClassLimits::new().max_in_flight_tokens(5))),
    );
    assert_eq!(
        plain.apply_limits(next),
        Err(LimitsError::Class(ClassLimitsError::TokensWithoutBudget {
            class: "a".into(),
            field: ClassField::MaxInFlightTokens,
        }))
    );
    let stats = plain.stats();
    assert_eq!(stats.limits.revision, 0);
}

#[cfg(feature = "serde")]
#[test]
fn class_limits_round_trip_as_json_for_a_control_plane() {
    let b = tiers();
    let json = serde_json::to_string(&b.limits()).unwrap();
    assert!(json.contains(r#""admission_classes":{"premium":{"protected_concurrent":1,"max_concurrent":3},"standard":{}}"#), "{json}");
    // A control plane pushes a new snapshot as JSON, keys in any order.
    let pushed: Limits = serde_json::from_str(
        r#"{"revision": 5, "max_concurrent": 6, "max_queue": 0,
            "token_budget": {"budget": 2000, "high_priority_reserve": 0},
            "admission_classes": {"standard": {"max_in_flight_tokens": 900},
                                  "premium": {"protected_concurrent": 2}}}"#,
    )
    .unwrap();
    b.apply_limits(pushed).unwrap();
    let now = b.limits();
    assert_eq!(now.revision, 5);
    let classes: Vec<_> = now
        .admission_classes
        .unwrap()
        .iter()
        .map(|(id, l)| (id.to_owned(), *l))
        .collect();
    assert_eq!(
        classes,
        [
            (
                "premium".to_owned(),
                ClassLimits::new().protected_concurrent(2)
            ),
            (
                "standard".to_owned(),
                ClassLimits::new().max_in_flight_tokens(900)
            ),
        ]
    );
}
