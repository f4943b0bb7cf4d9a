//! Builder: LlmBulkhead::builder(..).build()

use std::time::Duration;

use async_bulkhead_llm::{
    Limits, LlmBulkhead, LlmBulkheadBuilder, Profile, TokenBudget, builder::ConfigError,
    limits::MAX_BUDGET, limits::MAX_CONCURRENT, limits::MAX_REVISION,
};

use crate::support::{MODEL, probe};

/// `MAX_CONCURRENT` as the builder takes it.
const MAX: usize = MAX_CONCURRENT as usize;
/// Past what the limits' `u32` holds: refused, never truncated into range.
const HUGE: usize = u32::MAX as usize;

struct Case {
    name: &'static str,
    builder: LlmBulkheadBuilder,
    expected: ConfigError,
    display: &'static str,
}

fn cases() -> Vec<Case> {
    let b = LlmBulkhead::builder;
    let huge_budget = TokenBudget::new(u64::MAX)
        .high_priority_reserve(u64::MAX)
        .output_cap(u64::MAX);
    vec![
        Case {
            name: "empty model",
            builder: b("", 4),
            expected: ConfigError::EmptyModel { model: "".into() },
            display: "model must be a non-empty string (got \"\")",
        },
        Case {
            name: "single space model",
            builder: b(" ", 4),
            expected: ConfigError::EmptyModel { model: " ".into() },
            display: "model must be a non-empty string (got \" \")",
        },
        Case {
            name: "ASCII whitespace-only model",
            builder: b(" \t\r\n\x0b\x0c ", 4),
            expected: ConfigError::EmptyModel {
                model: " \t\r\n\x0b\x0c ".into(),
            },
            display: "model must be a non-empty string (got \" \\t\\r\\n\\u{b}\\u{c} \")",
        },
        Case {
            name: "Unicode whitespace-only model (NBSP, ideographic space, line separator)",
            builder: b("\u{a0}\u{3000}\u{2028}", 4),
            expected: ConfigError::EmptyModel {
                model: "\u{a0}\u{3000}\u{2028}".into(),
            },
            display: "model must be a non-empty string (got \"\\u{a0}\\u{3000}\\u{2028}\")",
        },
        Case {
            name: "empty model wins over every other invalid option",
            builder: b("  ", HUGE)
                .initial_revision(u64::MAX)
                .token_budget(huge_budget),
            expected: ConfigError::EmptyModel { model: "  ".into() },
            display: "model must be a non-empty string (got \"  \")",
        },
        Case {
            name: "max_concurrent MAX_CONCURRENT + 1",
            builder: b(MODEL, MAX + 1),
            expected: ConfigError::MaxConcurrentTooLarge {
                value: MAX + 1,
                max: MAX,
            },
            display: "max_concurrent (65536) must be <= 65535",
        },
        Case {
            name: "max_concurrent u32::MAX",
            builder: b(MODEL, HUGE),
            expected: ConfigError::MaxConcurrentTooLarge {
                value: HUGE,
                max: MAX,
            },
            display: "max_concurrent (4294967295) must be <= 65535",
        },
        Case {
            name: "max_concurrent wins over revision and budget",
            builder: b(MODEL, HUGE)
                .initial_revision(u64::MAX)
                .token_budget(huge_budget),
            expected: ConfigError::MaxConcurrentTooLarge {
                value: HUGE,
                max: MAX,
            },
            display: "max_concurrent (4294967295) must be <= 65535",
        },
        Case {
            name: "initial_revision MAX_REVISION + 1",
            builder: b(MODEL, 4).initial_revision(MAX_REVISION + 1),
            expected: ConfigError::InitialRevisionTooLarge {
                value: MAX_REVISION + 1,
                max: MAX_REVISION,
            },
            display: "initial_revision (9007199254740992) must be <= 9007199254740991",
        },
        Case {
            name: "initial_revision u64::MAX",
            builder: b(MODEL, 4).initial_revision(u64::MAX),
            expected: ConfigError::InitialRevisionTooLarge {
                value: u64::MAX,
                max: MAX_REVISION,
            },
            display: "initial_revision (18446744073709551615) must be <= 9007199254740991",
        },
        Case {
            name: "initial_revision wins over budget",
            builder: b(MODEL, 4)
                .initial_revision(u64::MAX)
                .token_budget(huge_budget),
            expected: ConfigError::InitialRevisionTooLarge {
                value: u64::MAX,
                max: MAX_REVISION,
            },
            display: "initial_revision (18446744073709551615) must be <= 9007199254740991",
        },
        Case {
            name: "budget MAX_BUDGET + 1",
            builder: b(MODEL, 4).token_budget(TokenBudget::new(MAX_BUDGET + 1)),
            expected: ConfigError::BudgetTooLarge {
                value: MAX_BUDGET + 1,
                max: MAX_BUDGET,
            },
            display: "token_budget.budget (34359738368) must be <= 34359738367",
        },
        Case {
            name: "budget u64::MAX",
            builder: b(MODEL, 4).token_budget(TokenBudget::new(u64::MAX)),
            expected: ConfigError::BudgetTooLarge {
                value: u64::MAX,
                max: MAX_BUDGET,
            },
            display: "token_budget.budget (18446744073709551615) must be <= 34359738367",
        },
        Case {
            name: "budget too large wins over reserve above budget",
            builder: b(MODEL, 4).token_budget(huge_budget),
            expected: ConfigError::BudgetTooLarge {
                value: u64::MAX,
                max: MAX_BUDGET,
            },
            display: "token_budget.budget (18446744073709551615) must be <= 34359738367",
        },
        Case {
            name: "reserve budget + 1",
            builder: b(MODEL, 4).token_budget(TokenBudget::new(100).high_priority_reserve(101)),
            expected: ConfigError::ReserveExceedsBudget {
                reserve: 101,
                budget: 100,
            },
            display: "token_budget.high_priority_reserve (101) must be <= token_budget.budget (100)",
        },
        Case {
            name: "reserve 1 over budget 0",
            builder: b(MODEL, 4).token_budget(TokenBudget::new(0).high_priority_reserve(1)),
            expected: ConfigError::ReserveExceedsBudget {
                reserve: 1,
                budget: 0,
            },
            display: "token_budget.high_priority_reserve (1) must be <= token_budget.budget (0)",
        },
        Case {
            name: "reserve u64::MAX over budget MAX_BUDGET",
            builder: b(MODEL, 4)
                .token_budget(TokenBudget::new(MAX_BUDGET).high_priority_reserve(u64::MAX)),
            expected: ConfigError::ReserveExceedsBudget {
                reserve: u64::MAX,
                budget: MAX_BUDGET,
            },
            display: "token_budget.high_priority_reserve (18446744073709551615) must be <= token_budget.budget (34359738367)",
        },
        Case {
            name: "reserve MAX_BUDGET + 1 over budget MAX_BUDGET",
            builder: b(MODEL, 4)
                .token_budget(TokenBudget::new(MAX_BUDGET).high_priority_reserve(MAX_BUDGET + 1)),
            expected: ConfigError::ReserveExceedsBudget {
                reserve: MAX_BUDGET + 1,
                budget: MAX_BUDGET,
            },
            display: "token_budget.high_priority_reserve (34359738368) must be <= token_budget.budget (34359738367)",
        },
    ]
}

#[test]
fn every_invalid_configuration_is_refused_with_its_typed_error_in_the_documented_order() {
    for case in cases() {
        let err = case.builder.build().expect_err(case.name);
        assert_eq!(err, case.expected, "{}", case.name);
        assert_eq!(err.to_string(), case.display, "{}: Display", case.name);
        // The spec's wording (design §U1.4 / §U16) for the model is a prefix of ours.
        if let ConfigError::EmptyModel { .. } = err {
            assert!(
                err.to_string()
                    .starts_with("model must be a non-empty string")
            );
        }
    }
}

#[test]
fn a_refused_build_leaves_the_builder_reusable_once_the_input_is_fixed() {
    // The builder is Clone: the refused clone changed nothing in the original.
    let builder = LlmBulkhead::builder(MODEL, 4)
        .initial_revision(7)
        .token_budget(TokenBudget::new(100).high_priority_reserve(101));
    assert!(builder.clone().build().is_err());
    assert!(
        builder.clone().build().is_err(),
        "refusing twice is the same"
    );
    let fixed = builder
        .token_budget(TokenBudget::new(100).high_priority_reserve(100))
        .build()
        .expect("fixed configuration");
    assert_eq!(
        fixed.limits(),
        Limits::new(7, 4).with_token_budget(100, 100)
    );
    let fresh = LlmBulkhead::builder(MODEL, 4)
        .initial_revision(7)
        .token_budget(TokenBudget::new(100).high_priority_reserve(100))
        .build()
        .unwrap();
    assert_eq!(fixed.stats(), fresh.stats());
    assert_eq!(probe(&fixed), probe(&fresh));
}

#[test]
fn models_with_surrounding_whitespace_or_odd_characters_are_accepted() {
    for model in [" m ", "\tm", "\u{3000}m\u{3000}", "m\0", "\u{200b}"] {
        let b = LlmBulkhead::builder(model, 1)
            .build()
            .unwrap_or_else(|e| panic!("{model:?}: {e}"));
        assert_eq!(b.model(), model, "the model is kept as given");
    }
}

#[test]
fn valid_edge_values_are_accepted_and_reported_as_limits() {
    let edges: Vec<(&str, LlmBulkheadBuilder, Limits, Option<Duration>)> = vec![
        (
            "max_concurrent 0",
            LlmBulkhead::builder(MODEL, 0),
            Limits::new(0, 0),
            None,
        ),
        (
            "max_concurrent MAX_CONCURRENT",
            LlmBulkhead::builder(MODEL, MAX),
            Limits::new(0, MAX_CONCURRENT),
            None,
        ),
        (
            "initial_revision MAX_REVISION",
            LlmBulkhead::builder(MODEL, 1).initial_revision(MAX_REVISION),
            Limits::new(MAX_REVISION, 1),
            None,
        ),
        (
            "budget 0 reserve 0 output cap 0",
            LlmBulkhead::builder(MODEL, 1).token_budget(TokenBudget::new(0).output_cap(0)),
            Limits::new(0, 1).with_token_budget(0, 0),
            None,
        ),
        (
            "budget MAX_BUDGET reserve MAX_BUDGET output cap u64::MAX",
            LlmBulkhead::builder(MODEL, 1).token_budget(
                TokenBudget::new(MAX_BUDGET)
                    .high_priority_reserve(MAX_BUDGET)
                    .output_cap(u64::MAX),
            ),
            Limits::new(0, 1).with_token_budget(MAX_BUDGET, MAX_BUDGET),
            None,
        ),
        (
            "max_queue u32::MAX, zero queue timeout",
            LlmBulkhead::builder(MODEL, 1)
                .max_queue(HUGE)
                .queue_timeout(Duration::ZERO),
            Limits::new(0, 1).with_max_queue(u32::MAX),
            Some(Duration::ZERO),
        ),
        (
            "queue timeout Duration::MAX",
            LlmBulkhead::builder(MODEL, 1).queue_timeout(Duration::MAX),
            Limits::new(0, 1),
            Some(Duration::MAX),
        ),
        (
            "custom profile with u32::MAX places and Duration::MAX",
            LlmBulkhead::builder(MODEL, 1).profile(Profile::Custom {
                max_queue: u32::MAX,
                timeout: Some(Duration::MAX),
            }),
            Limits::new(0, 1).with_max_queue(u32::MAX),
            Some(Duration::MAX),
        ),
        (
            "custom profile with 0 places and no timeout",
            LlmBulkhead::builder(MODEL, 1).profile(Profile::Custom {
                max_queue: 0,
                timeout: None,
            }),
            Limits::new(0, 1),
            None,
        ),
    ];
    for (name, builder, limits, timeout) in edges {
        let b = builder.build().unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(b.limits(), limits, "{name}");
        assert_eq!(b.queue_timeout(), timeout, "{name}");
        let stats = b.stats();
        assert_eq!(
            (
                stats.in_flight,
                stats.pending,
                stats.admitted,
                stats.rejected
            ),
            (0, 0, 0, 0),
            "{name}"
        );
    }
}
