//! The class part of limits (design §U8.2, §U8.4, with §U6.1 step 3): every kind of invalid
//! snapshot is refused with its exact error and changes nothing; a valid one is installed in
//! construction order.

use async_bulkhead_llm::{
    classes::ClassField, classes::ClassLimitsError, limits::LimitsError, limits::MAX_BUDGET,
    limits::MAX_CONCURRENT,
};

use crate::class_scenarios::{caps, class_limits, in_class, no_limits, with_classes};
use crate::reference::{Harness, Op};
use crate::scenarios::{ask, try_acquire};

#[test]
fn class_limits_are_validated_and_a_failure_changes_nothing() {
    // Design §U8.2: class limits present iff built with them, exactly the construction ids in
    // any order, each class as in §U6.1 step 3, then the floor sums against the new limits;
    // installed in construction order with floors of 0 omitted. §U8.4: `set_budget` not
    // below the token floors.
    let built = [caps(Some(1), Some(3), None, None), no_limits()];
    let mut h = Harness::new(with_classes(4, 0, Some((1000, 0)), 1, &built));
    h.apply(&try_acquire(in_class(0, ask(10, 10))));
    let refused = |class: &str, error| LimitsError::Class(error_for(class, error));
    let cases: Vec<(Op, Option<LimitsError>)> = vec![
        (
            class_limits(4, Some((1000, 0)), 5, 0, &built),
            Some(LimitsError::AdmissionClassesRequired),
        ),
        (
            class_limits(4, Some((1000, 0)), 6, 0, &built),
            Some(LimitsError::ClassIdsMismatch),
        ),
        (
            class_limits(4, Some((1000, 0)), 7, 0, &built),
            Some(LimitsError::ClassIdsMismatch),
        ),
        (
            class_limits(4, Some((1000, 0)), 8, 0, &built),
            Some(LimitsError::ClassIdsMismatch),
        ),
        (
            class_limits(
                4,
                Some((1000, 0)),
                1,
                0,
                &[
                    caps(None, Some(MAX_CONCURRENT + 1), None, None),
                    no_limits(),
                ],
            ),
            Some(refused(
                "premium",
                Fault::TooLarge(
                    ClassField::MaxConcurrent,
                    u64::from(MAX_CONCURRENT) + 1,
                    u64::from(MAX_CONCURRENT),
                ),
            )),
        ),
        (
            class_limits(
                4,
                Some((1000, 0)),
                1,
                0,
                &[no_limits(), caps(None, None, Some(MAX_BUDGET + 1), None)],
            ),
            Some(refused(
                "standard",
                Fault::TooLarge(
                    ClassField::ProtectedInFlightTokens,
                    MAX_BUDGET + 1,
                    MAX_BUDGET,
                ),
            )),
        ),
        (
            class_limits(
                4,
                Some((1000, 0)),
                1,
                0,
                &[caps(Some(3), Some(2), None, None), no_limits()],
            ),
            Some(refused(
                "premium",
                Fault::AboveMax(ClassField::ProtectedConcurrent, 3, 2),
            )),
        ),
        (
            class_limits(
                4,
                Some((1000, 0)),
                1,
                0,
                &[no_limits(), caps(None, None, Some(500), Some(400))],
            ),
            Some(refused(
                "standard",
                Fault::AboveMax(ClassField::ProtectedInFlightTokens, 500, 400),
            )),
        ),
        (
            class_limits(
                4,
                Some((1000, 0)),
                1,
                0,
                &[
                    caps(Some(3), None, None, None),
                    caps(Some(2), None, None, None),
                ],
            ),
            Some(LimitsError::ProtectedConcurrentSumTooLarge {
                sum: 5,
                max_concurrent: 4,
            }),
        ),
        (
            class_limits(
                4,
                Some((1000, 0)),
                1,
                0,
                &[
                    caps(None, None, Some(600), None),
                    caps(None, None, Some(500), None),
                ],
            ),
            Some(LimitsError::ProtectedTokensSumTooLarge {
                sum: 1100,
                budget: 1000,
            }),
        ),
        // The sums are against the new limits: the same floors fit a larger budget.
        (
            class_limits(
                4,
                Some((1100, 0)),
                1,
                0,
                &[
                    caps(Some(0), None, Some(600), None),
                    caps(None, None, Some(500), None),
                ],
            ),
            None,
        ),
        (Op::SetBudget { tokens: 1099 }, {
            Some(LimitsError::ProtectedTokensSumTooLarge {
                sum: 1100,
                budget: 1099,
            })
        }),
        (Op::SetBudget { tokens: 1100 }, None),
    ];
    for (op, expected) in cases {
        h.apply(&op);
        assert_eq!(
            h.inspect(|m| m.last_limits_error.clone()),
            expected,
            "{op:?}"
        );
    }
    // The last snapshot was applied with its ids reversed (order 1): installed in
    // construction order, premium's floor of 0 omitted.
    h.apply(&class_limits(
        4,
        Some((1100, 0)),
        1,
        1,
        &[
            caps(Some(0), Some(2), None, None),
            caps(Some(1), None, None, None),
        ],
    ));
    let table = h.inspect(|m| m.limits.classes.expect("classes"));
    let entries: Vec<_> = table.iter().copied().collect();
    assert_eq!(
        entries,
        [
            ("premium", caps(None, Some(2), None, None)),
            ("standard", caps(Some(1), None, None, None)),
        ]
    );
    // A stale snapshot is not examined, whatever its class part.
    let mut stale = class_limits(4, Some((1000, 0)), 6, 0, &built);
    if let Op::ApplyLimits { revision_delta, .. } = &mut stale {
        *revision_delta = 0;
    }
    h.apply(&stale);
    assert_eq!(h.inspect(|m| m.last_limits_error.clone()), None);
    let tally = h.finish_with_tally();
    assert_eq!(tally.get("class limits refused"), Some(&10));
    assert_eq!(tally.get("stale limits"), Some(&1));

    // Token limits need a budget (floor first); classes need classes.
    let mut h = Harness::new(with_classes(2, 0, None, 0, &[no_limits()]));
    h.apply(&class_limits(
        2,
        None,
        1,
        0,
        &[caps(None, None, Some(1), Some(1))],
    ));
    assert_eq!(
        h.inspect(|m| m.last_limits_error.clone()),
        Some(refused(
            "premium",
            Fault::WithoutBudget(ClassField::ProtectedInFlightTokens)
        ))
    );
    h.apply(&class_limits(
        2,
        None,
        1,
        0,
        &[caps(None, None, None, Some(1))],
    ));
    assert_eq!(
        h.inspect(|m| m.last_limits_error.clone()),
        Some(refused(
            "premium",
            Fault::WithoutBudget(ClassField::MaxInFlightTokens)
        ))
    );
    h.finish();
    let mut h = Harness::new(crate::scenarios::config(2, 0, None));
    h.apply(&class_limits(2, None, 5, 0, &[]));
    assert_eq!(
        h.inspect(|m| m.last_limits_error.clone()),
        Some(LimitsError::AdmissionClassesNotConfigured)
    );
    h.finish();
}

/// What is wrong with a class's limits.
enum Fault {
    TooLarge(ClassField, u64, u64),
    AboveMax(ClassField, u64, u64),
    WithoutBudget(ClassField),
}

fn error_for(class: &str, fault: Fault) -> ClassLimitsError {
    let class = class.to_owned();
    match fault {
        Fault::TooLarge(field, value, max) => ClassLimitsError::TooLarge {
            class,
            field,
            value,
            max,
        },
        Fault::AboveMax(field, protected, max) => ClassLimitsError::ProtectedAboveMax {
            class,
            field,
            protected,
            max,
        },
        Fault::WithoutBudget(field) => ClassLimitsError::TokensWithoutBudget { class, field },
    }
}
