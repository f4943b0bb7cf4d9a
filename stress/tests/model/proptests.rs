//! Random configurations and operation sequences, applied to the crate and the model; and
//! a coverage test proving the random sequences reach every case the scenarios pin.
//!
//! Failing cases are persisted next to this file, in `proptests.proptest-regressions`.

use std::collections::BTreeMap;

use async_bulkhead_llm::{limits::MAX_BUDGET, limits::MAX_CONCURRENT, limits::MAX_REVISION};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as ProptestConfig, FileFailurePersistence, TestRunner};

use std::time::Duration;

use crate::reference::{Call, ClassCaps, Classes, Config, Harness, MAX_CHARS, Op, Rate};

/// Token counts: mostly small (against budgets of a few thousand), sometimes at the edges of
/// what the crate can count or represent.
pub(crate) fn tokens() -> impl Strategy<Value = u64> {
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

/// Rate windows (valid ones: at most a unit per nanosecond of the window): a window of a
/// second, a tenth, or any length from a millisecond to two seconds (ticks then rarely fall on
/// whole nanoseconds or milliseconds); a few requests, a few thousand tokens, or both.
pub(crate) fn rate() -> impl Strategy<Value = Rate> {
    (
        prop_oneof![
            2 => Just(1_000_000_000u64),
            1 => Just(100_000_000u64),
            2 => 1_000_000..=2_000_000_000u64,
        ],
        prop::option::weighted(0.7, 1..=6u64),
        prop::option::weighted(0.5, prop_oneof![3 => 200..3000u64, 1 => 1..200u64]),
    )
        .prop_map(|(window_ns, requests, tokens)| Rate {
            window_ns,
            requests: requests.or(tokens.is_none().then_some(2)),
            tokens,
        })
}

/// Rate limits, sometimes ones the builder and `apply_limits` refuse (a window out of range,
/// no limit, a zero limit, more than a unit per nanosecond).
pub(crate) fn any_rate() -> impl Strategy<Value = Rate> {
    prop_oneof![
        12 => rate(),
        1 => (rate(), 0..8u8).prop_map(|(rate, how)| match how {
            0 => Rate { window_ns: 0, ..rate },
            1 => Rate { window_ns: 999_999, ..rate },
            2 => Rate { window_ns: 86_400_000_000_001, ..rate },
            3 => Rate { requests: Some(0), ..rate },
            4 => Rate { tokens: Some(0), ..rate },
            5 => Rate { requests: None, tokens: None, ..rate },
            6 => Rate { window_ns: 1_000_000, requests: Some(1_000_001), ..rate },
            _ => Rate { window_ns: 86_400_000_000_000, ..rate },
        }),
    ]
}

/// A move of the rate windows' clock: within a window mostly, sometimes whole milliseconds.
pub(crate) fn advance() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => 0..1_500_000_000u64,
        1 => (0..2000u64).prop_map(|ms| ms * 1_000_000),
    ]
    .prop_map(|ns| Op::Advance {
        by: Duration::from_nanos(ns),
    })
}

/// A small bulkhead with a queue and a budget (and sometimes rate windows).
fn busy_config() -> impl Strategy<Value = Config> {
    (
        1..=2u32,
        1..=4u32,
        500..3000u64,
        prop_oneof![Just(0u64), 0..500u64],
        prop::option::weighted(0.3, any_rate()),
    )
        .prop_map(
            |(max_concurrent, max_queue, budget, reserve, rate)| Config {
                max_concurrent,
                max_queue,
                budget: Some((budget, reserve)),
                initial_revision: 0,
                classes: None,
                dedup: None,
                rate,
            },
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
        prop::option::weighted(0.25, any_rate()),
    )
        .prop_map(
            |(max_concurrent, max_queue, budget, initial_revision, rate)| Config {
                max_concurrent,
                max_queue,
                budget,
                initial_revision,
                classes: None,
                dedup: None,
                rate,
            },
        )
}

pub(crate) fn call() -> impl Strategy<Value = Call> {
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
                class: 0,
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
    op_using(call)
}

/// The operations of the families without classes, with calls from `call`; `apply_limits`
/// keeps the class limits in force.
pub(crate) fn op_using<C: Strategy<Value = Call> + 'static>(
    call: fn() -> C,
) -> impl Strategy<Value = Op> {
    let index = any::<u32>;
    prop_oneof![
        10 => (any::<bool>(), call()).prop_map(|(owned, call)| Op::TryAcquire { owned, call }),
        12 => (any::<bool>(), timeout(), call())
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
                        class_shape: 0,
                        class_order: 0,
                        classes: Default::default(),
                    }
                }
            ),
        2 => prop_oneof![4 => 0..4000u64, 1 => tokens()].prop_map(|tokens| Op::SetBudget { tokens }),
        1 => Just(Op::Close),
        2 => any::<bool>().prop_map(|zero_timeout| Op::Drain { zero_timeout }),
        1 => prop::bool::weighted(0.7).prop_map(|on| Op::Listen { on }),
        3 => advance(),
        1 => (
            prop_oneof![8 => Just(1i64), 1 => Just(0i64)],
            prop::option::weighted(0.9, any_rate()),
        )
            .prop_map(|(revision_delta, rate)| Op::ApplyRate { revision_delta, rate }),
    ]
}

/// A queue timeout (see [`Op::Acquire`]): mostly none, sometimes zero, rarely long.
pub(crate) fn timeout() -> impl Strategy<Value = u8> {
    prop_oneof![8 => Just(0u8), 2 => Just(1u8), 1 => Just(2u8)]
}

// ----- the family with admission classes -----

/// One class's limits: small floors and ceilings (zeros included), sometimes a value too large
/// for the engine or the largest it counts.
fn class_caps() -> BoxedStrategy<ClassCaps> {
    (
        prop_oneof![6 => Just(None), 2 => Just(Some(0u32)), 4 => Just(Some(1u32)), 1 => Just(Some(2u32))],
        prop_oneof![8 => Just(None), 2 => Just(Some(0u32)), 4 => (1..=3u32).prop_map(Some)],
        prop_oneof![6 => Just(None), 1 => Just(Some(0u64)), 4 => (1..1200u64).prop_map(Some)],
        prop_oneof![8 => Just(None), 1 => Just(Some(0u64)), 4 => (0..2500u64).prop_map(Some)],
        prop_oneof![
            30 => Just(None),
            6 => (0..6u8).prop_map(Some),
        ],
    )
        .prop_map(|(protected_concurrent, max_concurrent, protected_tokens, max_tokens, huge)| {
            let mut caps = ClassCaps {
                protected_concurrent,
                max_concurrent,
                protected_tokens,
                max_tokens,
                rate: None,
            };
            match huge {
                Some(0) => caps.protected_concurrent = Some(MAX_CONCURRENT + 1),
                Some(1) => caps.max_concurrent = Some(MAX_CONCURRENT + 1),
                Some(2) => caps.protected_tokens = Some(MAX_BUDGET + 1),
                Some(3) => caps.max_tokens = Some(MAX_BUDGET + 1),
                // The largest valid ceilings.
                Some(4) => caps.max_concurrent = Some(MAX_CONCURRENT),
                Some(5) => caps.max_tokens = Some(MAX_BUDGET),
                _ => {}
            }
            caps
        })
    .boxed()
}

/// `caps` made to fit a bulkhead of `max_concurrent` slots and `budget` tokens, floor by floor
/// (so that most configurations keep floors): values in range, floors at most their ceilings
/// and what is left of the global limits, token limits only with a budget.
fn fit(caps: &mut [ClassCaps], max_concurrent: u32, budget: Option<u64>) {
    let (mut slots, mut tokens) = (max_concurrent, budget.unwrap_or(0));
    for c in caps {
        c.max_concurrent = c.max_concurrent.map(|n| n.min(MAX_CONCURRENT));
        let floor = c
            .protected_concurrent
            .map(|n| n.min(c.max_concurrent.unwrap_or(u32::MAX)).min(slots));
        slots -= floor.unwrap_or(0);
        c.protected_concurrent = floor;
        if budget.is_none() {
            c.protected_tokens = None;
            c.max_tokens = None;
        }
        c.max_tokens = c.max_tokens.map(|n| n.min(MAX_BUDGET));
        let floor = c
            .protected_tokens
            .map(|n| n.min(c.max_tokens.unwrap_or(u64::MAX)).min(tokens));
        tokens -= floor.unwrap_or(0);
        c.protected_tokens = floor;
    }
}

/// A bulkhead with 1 to 4 classes (a few without classes, a few configurations the builder
/// refuses, a few at the engine's bounds).
fn class_config() -> BoxedStrategy<Config> {
    (
        prop_oneof![1 => Just(0u32), 8 => 1..=4u32],
        prop_oneof![2 => Just(0u32), 3 => 1..=3u32],
        prop_oneof![
            1 => Just(None),
            3 => (500..4000u64, prop_oneof![3 => Just(0u64), 1 => 0..500u64]).prop_map(Some),
        ],
        0..3u64,
        (0..4usize, vec(class_caps(), 1..=4)),
        prop_oneof![1 => Just(0u8), 1 => Just(1u8), 1 => Just(3u8), 17 => Just(2u8)],
    )
        .prop_map(
            |(
                mut max_concurrent,
                max_queue,
                mut budget,
                initial_revision,
                (default, mut caps),
                kind,
            )| {
                // 0: no classes; 1: the classes as drawn (often refused); 3: at the engine's
                // bounds (the most slots and tokens, floors scaled up to them); else fitted.
                if kind == 3 {
                    max_concurrent = MAX_CONCURRENT;
                    budget = budget.map(|(_, reserve)| (MAX_BUDGET, reserve));
                    let tokens = MAX_BUDGET / 1200;
                    for c in &mut caps {
                        c.protected_concurrent = c
                            .protected_concurrent
                            .map(|n| n.saturating_mul(MAX_CONCURRENT / 2));
                        c.max_concurrent = c.max_concurrent.map(|n| n.saturating_mul(20_000));
                        c.protected_tokens = c.protected_tokens.map(|n| n.saturating_mul(tokens));
                        c.max_tokens = c.max_tokens.map(|n| n.saturating_mul(tokens));
                    }
                }
                if kind >= 2 {
                    fit(&mut caps, max_concurrent, budget.map(|(b, _)| b));
                }
                Config {
                    max_concurrent,
                    max_queue,
                    budget,
                    initial_revision,
                    classes: (kind > 0).then_some(Classes { default, caps }),
                    dedup: None,
                    rate: None,
                }
            },
        )
        .boxed()
}

/// A small bulkhead with two or three classes, a queue and a budget, where calls wait, are
/// handed slots, and are refused at their turn by class limits that changed while they waited.
/// Mostly without floors at first: while floors are kept, a call beyond its floor is refused
/// by protection rather than queued, and one within it finds a free slot (design §U6.4), so
/// only new limits make such calls wait. Often without ceilings at first too.
fn busy_class_config() -> BoxedStrategy<Config> {
    (
        1..=3u32,
        1..=4u32,
        (2000..12_000u64, prop_oneof![Just(0u64), 0..500u64]),
        (0..3usize, vec(class_caps(), 2..=3)),
        prop::bool::weighted(0.7),
        prop::bool::weighted(0.5),
    )
        .prop_map(
            |(max_concurrent, max_queue, budget, (default, mut caps), no_floors, no_ceilings)| {
                for c in &mut caps {
                    if no_floors {
                        c.protected_concurrent = None;
                        c.protected_tokens = None;
                    }
                    if no_ceilings {
                        c.max_concurrent = None;
                        c.max_tokens = None;
                    }
                }
                fit(&mut caps, max_concurrent, Some(budget.0));
                Config {
                    max_concurrent,
                    max_queue,
                    budget: Some(budget),
                    initial_revision: 0,
                    classes: Some(Classes { default, caps }),
                    dedup: None,
                    rate: None,
                }
            },
        )
        .boxed()
}

/// A call naming a class: mostly one of the bulkhead's, often none (the default class),
/// rarely another bulkhead's.
fn class_call() -> BoxedStrategy<Call> {
    (
        call(),
        prop_oneof![4 => Just(0u8), 12 => 1..=4u8, 1 => 5..=8u8],
    )
        .prop_map(|(call, class)| Call { class, ..call })
        .boxed()
}

/// New limits with a class part (see [`Op::ApplyLimits`]): mostly new floors and ceilings for
/// every class, sometimes the class part of the wrong shape.
fn class_limits_op() -> BoxedStrategy<Op> {
    (
        prop_oneof![8 => Just(1i64), 1 => Just(0i64)],
        prop_oneof![1 => Just(0u32), 8 => 1..=4u32],
        0..=3u32,
        prop::bool::weighted(0.03),
        prop_oneof![8 => 500..12_000u64, 1 => 0..500u64],
        prop_oneof![3 => Just(0u64), 1 => 0..500u64],
        prop_oneof![2 => Just(0u8), 10 => 1..=4u8, 2 => 5..=8u8],
        any::<u8>(),
        [class_caps(), class_caps(), class_caps(), class_caps()],
    )
        .prop_map(
            |(
                revision_delta,
                max_concurrent,
                max_queue,
                flip_budget,
                budget,
                reserve,
                class_shape,
                class_order,
                classes,
            )| Op::ApplyLimits {
                revision_delta,
                max_concurrent,
                max_queue,
                flip_budget,
                budget,
                reserve,
                class_shape,
                class_order,
                classes,
            },
        )
        .boxed()
}

/// A usage report small enough never to overflow.
pub(crate) fn small_usage() -> impl Strategy<Value = (u64, u64)> {
    (0..600u64, 0..1500u64)
}

fn class_op() -> BoxedStrategy<Op> {
    let index = any::<u32>;
    prop_oneof![
        66 => op_using(class_call).boxed(),
        6 => index().prop_map(|permit| Op::Abandon { permit }),
        5 => class_limits_op(),
        4 => (
            class_call(),
            timeout(),
            prop_oneof![
                3 => Just(0u8),
                1 => Just(1u8),
                3 => Just(2u8),
                2 => Just(3u8),
                1 => Just(4u8),
            ],
            prop::option::weighted(0.4, small_usage()),
            prop::bool::weighted(0.2),
            prop::bool::weighted(0.25),
        )
            .prop_map(
                |(call, timeout, deadline, report_first, abandon_first, finish_first)| Op::Run {
                    call,
                    timeout,
                    deadline,
                    report_first,
                    abandon_first,
                    finish_first,
                    observe: 0,
                },
            ),
        3 => (
            index(),
            small_usage(),
            prop::option::weighted(0.3, (0..1500u64, 0..200u64)),
        )
            .prop_map(|(run, (input, output), progressive)| Op::RunReport {
                run,
                input,
                output,
                progressive,
            }),
        2 => index().prop_map(|run| Op::RunAbandon { run }),
        3 => (index(), prop::bool::weighted(0.7), prop::option::weighted(0.6, small_usage()))
            .prop_map(|(run, ok, usage)| Op::RunFinish { run, ok, usage }),
        1 => index().prop_map(|run| Op::DropRun { run }),
    ]
    .boxed()
}

/// A cheap call in one of the bulkhead's classes (an explicit reservation of a few hundred
/// tokens): slots, not tokens, bind.
fn cheap_class_call() -> BoxedStrategy<Call> {
    (call(), 1..=4u8, 0..200u64, 0..300u64)
        .prop_map(|(call, class, input, max_output)| Call {
            class,
            explicit: true,
            input,
            max_output,
            ..call
        })
        .boxed()
}

/// New limits giving one class (and only it) a floor of one slot, over calls that may hold
/// every slot already: a call of that class is then within its floor but finds no slot
/// (design §U6.4, "a floor is not a guaranteed slot").
fn raise_floor_op() -> BoxedStrategy<Op> {
    (
        1..=3u32,
        prop_oneof![Just(0u32), 1..=3u32],
        2000..12_000u64,
        0..4usize,
        any::<u8>(),
    )
        .prop_map(|(max_concurrent, max_queue, budget, class, class_order)| {
            let mut classes: [ClassCaps; 4] = Default::default();
            classes[class].protected_concurrent = Some(1);
            Op::ApplyLimits {
                revision_delta: 1,
                max_concurrent,
                max_queue,
                flip_budget: false,
                budget,
                reserve: 0,
                class_shape: 1,
                class_order,
                classes,
            }
        })
        .boxed()
}

/// The class operations, with more cheap calls that wait and more changes of class limits
/// under them.
fn busy_class_op() -> BoxedStrategy<Op> {
    prop_oneof![
        20 => class_op(),
        3 => (any::<bool>(), timeout(), cheap_class_call())
            .prop_map(|(owned, timeout, call)| Op::Acquire { owned, timeout, call }),
        1 => (any::<bool>(), cheap_class_call())
            .prop_map(|(owned, call)| Op::TryAcquire { owned, call }),
        2 => class_limits_op(),
        1 => raise_floor_op(),
    ]
    .boxed()
}

pub(crate) fn run(config: Config, ops: &[Op]) -> BTreeMap<&'static str, u64> {
    let mut harness = Harness::new(config);
    for op in ops {
        harness.apply(op);
    }
    harness.finish_with_tally()
}

pub(crate) fn proptest_config(cases: u32) -> ProptestConfig {
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
        config in busy_config(),
        ops in vec(op(), 20..=60),
    ) {
        run(config, &ops);
    }
}

proptest! {
    #![proptest_config(proptest_config(CLASS_CASES))]

    /// Admission classes: any class configuration, any sequence of operations, including
    /// abandonment, class limits and runs with borrowed-slot deadlines.
    #[test]
    fn the_crate_agrees_with_the_model_with_classes(
        config in class_config(),
        ops in vec(class_op(), 1..=60),
    ) {
        run(config, &ops);
    }

    /// Classes on a small bulkhead with a queue: waiting, hand-offs, abandoned slots serving
    /// the queue, and heads refused by their class at their turn.
    #[test]
    fn the_crate_agrees_with_the_model_on_a_busy_queue_with_classes(
        config in busy_class_config(),
        ops in vec(busy_class_op(), 20..=60),
    ) {
        run(config, &ops);
    }
}

/// Classes with rate windows: the bulkhead's sometimes, each class's often (a class's own
/// windows beside the bulkhead's, crate rate.rs).
fn class_rate_config() -> BoxedStrategy<Config> {
    (
        class_config(),
        prop::option::weighted(0.4, any_rate()),
        [0; MAX_CLASS_RATES].map(|_| prop::option::weighted(0.6, any_rate())),
    )
        .prop_map(|(config, rate, rates)| {
            let mut config = Config { rate, ..config };
            if let Some(classes) = &mut config.classes {
                for (caps, rate) in classes.caps.iter_mut().zip(rates) {
                    caps.rate = rate;
                }
            }
            config
        })
        .boxed()
}

/// As many classes as a configuration has at most.
const MAX_CLASS_RATES: usize = 4;

/// New class limits with rate windows of their own (or none), or other rate limits for the
/// bulkhead.
fn class_rate_limits_op() -> BoxedStrategy<Op> {
    (
        class_limits_op(),
        [0; MAX_CLASS_RATES].map(|_| prop::option::weighted(0.6, any_rate())),
    )
        .prop_map(|(op, rates)| match op {
            Op::ApplyLimits {
                revision_delta,
                max_concurrent,
                max_queue,
                flip_budget,
                budget,
                reserve,
                class_shape,
                class_order,
                mut classes,
            } => {
                for (caps, rate) in classes.iter_mut().zip(rates) {
                    caps.rate = rate;
                }
                Op::ApplyLimits {
                    revision_delta,
                    max_concurrent,
                    max_queue,
                    flip_budget,
                    budget,
                    reserve,
                    class_shape,
                    class_order,
                    classes,
                }
            }
            other => other,
        })
        .boxed()
}

/// The class operations without `run` (not modelled with windows), with the clock moving.
fn class_rate_op() -> BoxedStrategy<Op> {
    prop_oneof![
        60 => op_using(class_call).boxed(),
        6 => any::<u32>().prop_map(|permit| Op::Abandon { permit }),
        4 => class_rate_limits_op(),
        4 => advance().boxed(),
    ]
    .boxed()
}

/// Cases of the class family with rate windows.
const CLASS_RATE_CASES: u32 = 300;

proptest! {
    #![proptest_config(proptest_config(CLASS_RATE_CASES))]

    /// Admission classes with rate windows of their own and the bulkhead's.
    #[test]
    fn the_crate_agrees_with_the_model_with_class_windows(
        config in class_rate_config(),
        ops in vec(class_rate_op(), 1..=60),
    ) {
        run(config, &ops);
    }
}

/// The random class sequences with windows reach every class window's refusal and
/// correction.
#[test]
fn random_class_rate_sequences_reach_the_class_rate_cases() {
    assert_reached(
        (class_rate_config(), vec(class_rate_op(), 1..=60)),
        150,
        &EVERY_CLASS_RATE_CASE,
    );
}

const EVERY_CLASS_RATE_CASE: [&str; 10] = [
    "class limits refused: rate",
    "class rate limits changed",
    "class rate limits changed with units charged",
    "class rate window spent",
    "rate charge given back: refused now",
    "rate usage corrected on a class window",
    "refused: class requests window",
    "refused: class tokens window",
    "refused: requests window",
    "refused: tokens window",
];

/// Cases of each class family.
const CLASS_CASES: u32 = 2000;

/// Runs `cases` random sequences of `strategy` and fails naming every situation of `every`
/// that none of them reached.
pub(crate) fn assert_reached(
    strategy: impl Strategy<Value = (Config, Vec<Op>)>,
    cases: usize,
    every: &[&str],
) {
    let mut runner = TestRunner::deterministic();
    let mut total: BTreeMap<&str, u64> = BTreeMap::new();
    for _ in 0..cases {
        let (config, ops) = strategy
            .new_tree(&mut runner)
            .expect("a generated case")
            .current();
        for (what, count) in run(config, &ops) {
            *total.entry(what).or_insert(0) += count;
        }
    }
    let missing: Vec<&str> = every
        .iter()
        .copied()
        .filter(|what| !total.contains_key(what))
        .collect();
    assert!(
        missing.is_empty(),
        "never reached: {missing:?}\nreached: {total:#?}"
    );
}

/// The random sequences of the two families above do reach every situation the scenarios
/// pin.
#[test]
fn random_sequences_reach_the_interesting_cases() {
    let strategy = prop_oneof![
        1 => (any_config(), vec(op(), 1..=60)),
        1 => (busy_config(), vec(op(), 20..=60)),
    ];
    assert_reached(strategy, 300, &EVERY_CASE);
}

/// The random class sequences reach every class reason and every way of abandoning.
#[test]
fn random_class_sequences_reach_the_class_cases() {
    let strategy = prop_oneof![
        1 => (class_config(), vec(class_op(), 1..=60)),
        1 => (busy_class_config(), vec(busy_class_op(), 20..=60)),
    ];
    assert_reached(strategy, 400, &EVERY_CLASS_CASE);
}

/// Configurations that always have rate windows.
fn rate_config() -> impl Strategy<Value = Config> {
    (any_config(), any_rate()).prop_map(|(config, rate)| Config {
        rate: Some(rate),
        ..config
    })
}

/// The random sequences with rate windows reach every way a window refuses, gives a charge
/// back and corrects it.
#[test]
fn random_rate_sequences_reach_the_rate_cases() {
    assert_reached((rate_config(), vec(op(), 1..=60)), 200, &EVERY_RATE_CASE);
}

const EVERY_RATE_CASE: [&str; 17] = [
    "clock advanced",
    "rate limits changed",
    "rate limits changed with units charged",
    "rate limits refused",
    "queued with a rate charge",
    "rate charge given back",
    "rate charge given back: refused now",
    "rate charge given back: wait cancelled",
    "rate charge given back: wait ended refused",
    "rate usage charged beyond",
    "rate usage given back",
    "rate window partly spent",
    "rate window spent",
    "refused: rate_limit",
    "refused: requests window",
    "refused: tokens window",
    "refused: tokens window, never fits",
];

const EVERY_CLASS_CASE: [&str; 35] = [
    "abandon refused: already abandoned",
    "abandon refused: slot not borrowed",
    "abandoned slot served the queue",
    "abandoned: deadline",
    "abandoned: manual",
    "budget below the token floors refused",
    "cancelled after a hand-off",
    "class limits changed under calls in flight",
    "class limits refused",
    "class limits refused: floor above ceiling",
    "class limits refused: floor sum",
    "class limits refused: ids mismatch",
    "class limits refused: required",
    "class limits refused: token floor sum",
    "class limits refused: tokens without a budget",
    "class limits refused: too large",
    "class token identity checked",
    "class token identity checked at a step",
    "classes at the engine's bounds",
    "classes refused by the builder",
    "deadline passed",
    "invalid request: classes not configured",
    "invalid request: foreign class",
    "queue head refused by its class",
    "refused: class concurrency ceiling",
    "refused: class token ceiling",
    "refused: concurrency protection",
    "refused: global concurrency within a floor",
    "refused: token protection",
    "released an abandoned admission",
    "run deadline not applied: slot within the floor",
    "run dropped while running",
    "run dropped while waiting",
    "run finished first under a deadline",
    "run: zero deadline refused",
];

const EVERY_CASE: [&str; 29] = [
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
    "returned a hold unreported",
    "stale limits",
    "stale usage report",
    "token identity checked",
    "token identity checked at a step",
    "tokens re-held",
    "usage error: clamped total overflows",
    "usage error: hold overflows",
    "usage error: remaining exceeds cap",
];
