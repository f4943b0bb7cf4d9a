//! Random configurations and operation sequences, applied to the crate and the model; and
//! a coverage test proving the random sequences reach every case the scenarios pin.
//!
//! Failing cases are persisted next to this file, in `proptests.proptest-regressions`.

use std::collections::BTreeMap;

use async_bulkhead_llm::{MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as ProptestConfig, FileFailurePersistence, TestRunner};

use crate::reference::{Call, Config, Harness, MAX_CHARS, Op};

/// Token counts: mostly small (against budgets of a few thousand), sometimes at the edges of
/// what the crate can count or represent.
fn tokens() -> impl Strategy<Value = u64> {
    prop_oneof![
        10 => 0..400u64,
        4 => 400..2500u64,
        1 => Just(0u64),
        1 => prop_oneof![
            Just(MAX_BUDGET),
            Just(MAX_BUDGET + 1),
            Just(u64::MAX),
            Just(u64::MAX / 2 + 1),
            any::<u64>(),
        ],
    ]
}

fn budget() -> impl Strategy<Value = (u64, u64)> {
    (
        prop_oneof![
            8 => 0..4000u64,
            1 => Just(0u64),
            1 => Just(MAX_BUDGET),
            1 => prop_oneof![Just(MAX_BUDGET + 1), Just(u64::MAX)],
        ],
        prop_oneof![4 => Just(0u64), 4 => 0..1500u64, 1 => any::<u64>()],
    )
}

fn any_config() -> impl Strategy<Value = Config> {
    (
        prop_oneof![
            12 => 0..=3u32,
            1 => Just(MAX_CONCURRENT),
            1 => prop_oneof![Just(MAX_CONCURRENT + 1), Just(u32::MAX)],
        ],
        prop_oneof![3 => 1..=4u32, 1 => Just(0u32), 1 => Just(u32::MAX)],
        prop_oneof![1 => Just(None), 3 => budget().prop_map(Some)],
        prop_oneof![
            8 => 0..4u64,
            1 => (MAX_REVISION - 2)..=MAX_REVISION,
            1 => prop_oneof![Just(MAX_REVISION + 1), Just(u64::MAX)],
        ],
    )
        .prop_map(
            |(max_concurrent, max_queue, budget, initial_revision)| Config {
                max_concurrent,
                max_queue,
                budget,
                initial_revision,
            },
        )
}

fn call() -> impl Strategy<Value = Call> {
    (
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.7),
        tokens(),
        tokens(),
        0..4u8,
        prop_oneof![3 => 0..2000u32, 1 => 0..MAX_CHARS],
        (prop::bool::weighted(0.7), tokens()),
        (prop::bool::weighted(0.15), tokens()),
    )
        .prop_map(
            |(
                high,
                explicit,
                input,
                max_output,
                model,
                chars,
                (has_max_tokens, max_tokens),
                (has_extra_input, extra_input),
            )| Call {
                high,
                explicit,
                input,
                max_output,
                model,
                chars,
                has_max_tokens,
                max_tokens,
                has_extra_input,
                extra_input,
            },
        )
}

fn op() -> impl Strategy<Value = Op> {
    let index = any::<u32>;
    prop_oneof![
        10 => (any::<bool>(), call()).prop_map(|(owned, call)| Op::TryAcquire { owned, call }),
        12 => (any::<bool>(), prop_oneof![8 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8)], call())
            .prop_map(|(owned, timeout, call)| Op::Acquire { owned, timeout, call }),
        3 => (any::<bool>(), call())
            .prop_map(|(with_detail, call)| Op::WouldAdmit { with_detail, call }),
        1 => call().prop_map(|call| Op::Estimate { call }),
        5 => (index(), tokens(), tokens())
            .prop_map(|(permit, input, output)| Op::ReportUsage { permit, input, output }),
        // Cumulative usage whose total no longer fits in 64 bits.
        1 => (index(), prop_oneof![Just(u64::MAX), Just(u64::MAX - 1)], 1..3u64)
            .prop_map(|(permit, input, output)| Op::ReportUsage { permit, input, output }),
        5 => (
            index(),
            tokens(),
            tokens(),
            prop_oneof![1 => Just(0u64), 4 => tokens()],
            prop_oneof![2 => Just(0u64), 3 => 0..200u64, 1 => tokens()],
        )
            .prop_map(|(permit, input, output, remaining, margin)| Op::ReportProgressive {
                permit,
                input,
                output,
                remaining,
                margin,
            }),
        8 => (index(), prop::bool::weighted(0.7), tokens(), tokens()).prop_map(
            |(permit, with_usage, input, output)| Op::Release {
                permit,
                with_usage,
                input,
                output,
            }
        ),
        4 => index().prop_map(|permit| Op::DropPermit { permit }),
        3 => index().prop_map(|waiter| Op::CancelWaiter { waiter }),
        2 => index().prop_map(|waiter| Op::PollWaiter { waiter }),
        2 => any::<bool>().prop_map(|on| Op::AutoPoll { on }),
        4 => (
            prop_oneof![6 => 1..=2i64, 2 => -1..=0i64, 1 => Just(i64::MAX), 1 => any::<i64>()],
            prop_oneof![10 => 0..=4u32, 1 => Just(MAX_CONCURRENT + 1)],
            0..=4u32,
            prop::bool::weighted(0.08),
            prop_oneof![8 => 0..4000u64, 1 => tokens()],
            prop_oneof![4 => 0..1500u64, 1 => tokens()],
        )
            .prop_map(
                |(revision_delta, max_concurrent, max_queue, flip_budget, budget, reserve)| {
                    Op::ApplyLimits {
                        revision_delta,
                        max_concurrent,
                        max_queue,
                        flip_budget,
                        budget,
                        reserve,
                    }
                }
            ),
        2 => prop_oneof![4 => 0..4000u64, 1 => tokens()].prop_map(|tokens| Op::SetBudget { tokens }),
        1 => Just(Op::Close),
        2 => any::<bool>().prop_map(|zero_timeout| Op::Drain { zero_timeout }),
        1 => prop::bool::weighted(0.7).prop_map(|on| Op::Listen { on }),
    ]
}

pub(crate) fn run(config: Config, ops: &[Op]) -> BTreeMap<&'static str, u64> {
    let mut harness = Harness::new(config);
    for op in ops {
        harness.apply(op);
    }
    harness.finish_with_tally()
}

fn proptest_config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(proptest_config(600))]

    /// Any configuration, any sequence of operations.
    #[test]
    fn the_crate_agrees_with_the_model(config in any_config(), ops in vec(op(), 1..=60)) {
        let mut harness = Harness::new(config);
        for op in &ops {
            harness.apply(op);
        }
        harness.finish();
    }

    /// A small bulkhead with a queue and a budget, where waiting, hand-offs and refusals at
    /// the head's turn are frequent.
    #[test]
    fn the_crate_agrees_with_the_model_on_a_busy_queue(
        max_concurrent in 1..=2u32,
        max_queue in 1..=4u32,
        budget in 500..3000u64,
        reserve in prop_oneof![Just(0u64), 0..500u64],
        ops in vec(op(), 20..=60),
    ) {
        let config = Config { max_concurrent, max_queue, budget: Some((budget, reserve)), initial_revision: 0 };
        run(config, &ops);
    }
}

/// The random sequences above do reach every situation the scenarios below pin.
#[test]
fn random_sequences_reach_the_interesting_cases() {
    let mut runner = TestRunner::deterministic();
    let strategy = (any_config(), vec(op(), 1..=60));
    let mut total: BTreeMap<&str, u64> = BTreeMap::new();
    for _ in 0..300 {
        let (config, ops) = strategy
            .new_tree(&mut runner)
            .expect("a generated case")
            .current();
        for (what, count) in run(config, &ops) {
            *total.entry(what).or_insert(0) += count;
        }
    }
    let missing: Vec<&str> = EVERY_CASE
        .iter()
        .copied()
        .filter(|what| !total.contains_key(what))
        .collect();
    assert!(
        missing.is_empty(),
        "never reached: {missing:?}\nreached: {total:#?}"
    );
}

const EVERY_CASE: [&str; 27] = [
    "admitted into the high-priority reserve",
    "budget set",
    "cancelled after a hand-off",
    "cancelled after a refusal",
    "cancelled while queued",
    "handed a slot and tokens",
    "hold driven to zero",
    "invalid explicit reservation",
    "invalid request",
    "limits applied",
    "limits changed while calls wait",
    "limits refused",
    "overrun booked",
    "pending drain completed",
    "queue head refused for its tokens",
    "refused: budget_limit",
    "refused: concurrency_limit",
    "refused: queue_limit",
    "refused: shutdown",
    "refused: timeout",
    "stale limits",
    "stale usage report",
    "token identity checked",
    "tokens re-held",
    "usage error: clamped total overflows",
    "usage error: hold overflows",
    "usage error: remaining exceeds cap",
];
