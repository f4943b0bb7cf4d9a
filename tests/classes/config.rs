//! Building a bulkhead with admission classes: every validation in its order, class handles,
//! and calls naming a class the bulkhead cannot take.

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget, builder::ConfigError,
    classes::AdmissionClasses, classes::ClassField, classes::ClassLimits,
    classes::ClassLimitsError, classes::ClassLookupError, limits::MAX_BUDGET,
    limits::MAX_CONCURRENT, request::RequestError,
};

fn build(
    max_concurrent: usize,
    budget: Option<u64>,
    classes: AdmissionClasses,
) -> Result<LlmBulkhead, ConfigError> {
    let mut builder = LlmBulkhead::builder("m", max_concurrent).admission_classes(classes);
    if let Some(budget) = budget {
        builder = builder.token_budget(TokenBudget::new(budget));
    }
    builder.build()
}

fn class_error(error: ConfigError) -> ClassLimitsError {
    match error {
        ConfigError::Class(e) => e,
        other => panic!("expected a class error, got {other:?}"),
    }
}

#[test]
fn every_class_validation_is_a_typed_error_in_upstream_order() {
    let ok = ClassLimits::new();
    // 1. The default class id must not be blank (checked before anything else).
    assert_eq!(
        build(4, None, AdmissionClasses::new("  ").class("", ok)).unwrap_err(),
        ConfigError::DefaultClassEmpty {
            default_class: "  ".into()
        }
    );
    // 3. At least one class.
    assert_eq!(
        build(4, None, AdmissionClasses::new("a")).unwrap_err(),
        ConfigError::NoClasses
    );
    // 4. Each class in order: its id...
    assert_eq!(
        class_error(build(4, None, AdmissionClasses::new("a").class(" ", ok)).unwrap_err()),
        ClassLimitsError::EmptyId { class: " ".into() }
    );
    assert_eq!(
        class_error(
            build(
                4,
                None,
                AdmissionClasses::new("a").class("a", ok).class("a", ok)
            )
            .unwrap_err()
        ),
        ClassLimitsError::DuplicateId { class: "a".into() }
    );
    // ...its values (each must fit what the engine counts)...
    let too_many = ClassLimits::new().max_concurrent(MAX_CONCURRENT + 1);
    assert_eq!(
        class_error(build(4, None, AdmissionClasses::new("a").class("a", too_many)).unwrap_err()),
        ClassLimitsError::TooLarge {
            class: "a".into(),
            field: ClassField::MaxConcurrent,
            value: u64::from(MAX_CONCURRENT) + 1,
            max: u64::from(MAX_CONCURRENT),
        }
    );
    let too_many_tokens = ClassLimits::new().protected_in_flight_tokens(MAX_BUDGET + 1);
    assert!(matches!(
        class_error(
            build(
                4,
                Some(10),
                AdmissionClasses::new("a").class("a", too_many_tokens)
            )
            .unwrap_err()
        ),
        ClassLimitsError::TooLarge {
            field: ClassField::ProtectedInFlightTokens,
            ..
        }
    ));
    // ...a floor above its own ceiling (concurrency before tokens)...
    let both = ClassLimits::new()
        .protected_concurrent(3)
        .max_concurrent(2)
        .protected_in_flight_tokens(5)
        .max_in_flight_tokens(4);
    assert_eq!(
        class_error(build(4, Some(10), AdmissionClasses::new("a").class("a", both)).unwrap_err()),
        ClassLimitsError::ProtectedAboveMax {
            class: "a".into(),
            field: ClassField::ProtectedConcurrent,
            protected: 3,
            max: 2,
        }
    );
    let tokens_only = ClassLimits::new()
        .protected_in_flight_tokens(5)
        .max_in_flight_tokens(4);
    assert_eq!(
        class_error(
            build(
                4,
                Some(10),
                AdmissionClasses::new("a").class("a", tokens_only)
            )
            .unwrap_err()
        ),
        ClassLimitsError::ProtectedAboveMax {
            class: "a".into(),
            field: ClassField::ProtectedInFlightTokens,
            protected: 5,
            max: 4,
        }
    );
    // ...and token limits without a budget (floor first).
    let tokens = ClassLimits::new()
        .protected_in_flight_tokens(1)
        .max_in_flight_tokens(2);
    assert_eq!(
        class_error(build(4, None, AdmissionClasses::new("a").class("a", tokens)).unwrap_err()),
        ClassLimitsError::TokensWithoutBudget {
            class: "a".into(),
            field: ClassField::ProtectedInFlightTokens,
        }
    );
    let ceiling = ClassLimits::new().max_in_flight_tokens(2);
    assert_eq!(
        class_error(build(4, None, AdmissionClasses::new("a").class("a", ceiling)).unwrap_err()),
        ClassLimitsError::TokensWithoutBudget {
            class: "a".into(),
            field: ClassField::MaxInFlightTokens,
        }
    );
    // A bad second class is found after a good first one; classes are checked before the
    // default class is looked up.
    assert!(matches!(
        build(
            4,
            None,
            AdmissionClasses::new("zzz").class("a", ok).class("", ok)
        )
        .unwrap_err(),
        ConfigError::Class(ClassLimitsError::EmptyId { .. })
    ));
    // 5. The default class must be configured.
    assert_eq!(
        build(4, None, AdmissionClasses::new("b").class("a", ok)).unwrap_err(),
        ConfigError::UnknownDefaultClass {
            default_class: "b".into()
        }
    );
    // 6. The floors' sums fit the global limits (concurrency first).
    let floors = |slots, tokens| {
        AdmissionClasses::new("a")
            .class(
                "a",
                ClassLimits::new()
                    .protected_concurrent(slots)
                    .protected_in_flight_tokens(tokens),
            )
            .class(
                "b",
                ClassLimits::new()
                    .protected_concurrent(slots)
                    .protected_in_flight_tokens(tokens),
            )
    };
    assert_eq!(
        build(4, Some(10), floors(3, 6)).unwrap_err(),
        ConfigError::ProtectedConcurrentSumTooLarge {
            sum: 6,
            max_concurrent: 4
        }
    );
    assert_eq!(
        build(4, Some(10), floors(2, 6)).unwrap_err(),
        ConfigError::ProtectedTokensSumTooLarge {
            sum: 12,
            budget: 10
        }
    );
    // Exact fits are fine, and zero is valid everywhere.
    build(4, Some(12), floors(2, 6)).unwrap();
    let zeros = ClassLimits::new()
        .protected_concurrent(0)
        .max_concurrent(0)
        .protected_in_flight_tokens(0)
        .max_in_flight_tokens(0);
    build(0, Some(0), AdmissionClasses::new("z").class("z", zeros)).unwrap();
}

#[test]
fn errors_name_the_class_and_the_field() {
    let e = build(
        4,
        None,
        AdmissionClasses::new("a").class("a", ClassLimits::new().max_in_flight_tokens(1)),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "admission_classes.classes[\"a\"].max_in_flight_tokens requires a token budget to be configured"
    );
    let e = build(
        4,
        None,
        AdmissionClasses::new("a").class(
            "a",
            ClassLimits::new().protected_concurrent(2).max_concurrent(1),
        ),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "admission_classes.classes[\"a\"].protected_concurrent (2) must be <= admission_classes.classes[\"a\"].max_concurrent (1)"
    );
}

#[test]
fn ids_are_kept_verbatim_and_in_order() {
    let b = build(
        8,
        None,
        AdmissionClasses::new(" spaced ")
            .class("zeta", ClassLimits::new())
            .class(" spaced ", ClassLimits::new())
            .class("alpha", ClassLimits::new()),
    )
    .unwrap();
    let ids: Vec<_> = b.classes().iter().map(|c| c.id()).collect();
    assert_eq!(ids, ["zeta", " spaced ", "alpha"]);
    assert_eq!(b.default_class().unwrap().id(), " spaced ");
    let limits = b.limits().admission_classes.unwrap();
    assert_eq!(limits.iter().map(|(id, _)| id).collect::<Vec<_>>(), ids);
    let stats = b.stats().admission_classes.unwrap();
    assert_eq!(
        stats
            .classes
            .iter()
            .map(|c| c.class.id())
            .collect::<Vec<_>>(),
        ids
    );
    // A trimmed name is another name.
    assert!(matches!(
        b.class("spaced"),
        Err(ClassLookupError::Unknown { .. })
    ));
}

#[test]
fn a_class_the_bulkhead_cannot_take_is_refused_and_changes_nothing() {
    let plain = LlmBulkhead::builder("m", 2).build().unwrap();
    assert_eq!(plain.class("a"), Err(ClassLookupError::NotConfigured));
    assert!(plain.classes().is_empty());
    let classed = build(
        2,
        None,
        AdmissionClasses::new("a").class("a", ClassLimits::new()),
    )
    .unwrap();
    // A handle names an id at a position: the same id at the same position elsewhere is the
    // same class, the same id at another position is not.
    let twin = build(
        2,
        None,
        AdmissionClasses::new("a").class("a", ClassLimits::new()),
    )
    .unwrap();
    let other = build(
        2,
        None,
        AdmissionClasses::new("a")
            .class("b", ClassLimits::new())
            .class("a", ClassLimits::new()),
    )
    .unwrap();
    let a = classed.class("a").unwrap();
    assert_eq!(twin.class("a"), Ok(a));
    assert_ne!(other.class("a"), Ok(a));
    drop(
        twin.try_acquire(&LlmRequest::new(), AcquireOptions::new().class(a))
            .unwrap(),
    );

    let request = LlmRequest::new();
    match plain.try_acquire(&request, AcquireOptions::new().class(a)) {
        Err(AcquireError::Invalid(RequestError::ClassesNotConfigured { class })) => {
            assert_eq!(class, a);
        }
        other => panic!("{other:?}"),
    }
    match other.try_acquire(&request, AcquireOptions::new().class(a)) {
        Err(AcquireError::Invalid(RequestError::ForeignClass { class })) => assert_eq!(class, a),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        other.would_admit(&request, AcquireOptions::new().class(a)),
        Err(RequestError::ForeignClass { .. })
    ));
    for b in [&plain, &other] {
        let stats = b.stats();
        assert_eq!((stats.admitted, stats.rejected, stats.in_flight), (0, 0, 0));
    }
    let stats = other.stats().admission_classes.unwrap();
    assert_eq!(
        (stats.classes[0].admitted, stats.classes[0].rejected),
        (0, 0)
    );
}
