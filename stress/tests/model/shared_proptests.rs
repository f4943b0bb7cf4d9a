//! Random sequences with in-flight deduplication and observe mode: `run_shared` calls that
//! lead, follow (identical requests, in scopes and classes) or run alone, whose followers time
//! out or are dropped, whose leaders fail or are dropped while followers drive the call; and
//! `run` / `run_shared` calls in observe mode, bypassed on a predicted refusal or after a
//! counted one. Applied to the crate and the model like the other families, with a coverage
//! test proving the sequences reach every such case.

use proptest::collection::vec;
use proptest::prelude::*;

use crate::proptests::{
    assert_reached, call, op_using, proptest_config, run, small_usage, timeout,
};
use crate::reference::{Call, ClassCaps, Classes, Config, DedupKind, Op, Step};

/// A bulkhead with deduplication (mostly by the whole request, sometimes by a key function,
/// rarely none), few slots, a short queue, mostly a budget, sometimes two or three classes
/// (so a class partitions the keys).
fn dedup_config() -> BoxedStrategy<Config> {
    (
        prop_oneof![1 => Just(0u32), 6 => 1..=2u32],
        prop_oneof![1 => Just(0u32), 3 => 1..=3u32],
        prop_oneof![
            1 => Just(None),
            4 => (300..4000u64, prop_oneof![3 => Just(0u64), 1 => 0..300u64]).prop_map(Some),
        ],
        prop_oneof![
            1 => Just(None),
            6 => Just(Some(DedupKind::ByRequest)),
            3 => Just(Some(DedupKind::ByModel)),
        ],
        prop_oneof![
            3 => Just(None),
            1 => (0..3usize, vec(prop_oneof![
                3 => Just(ClassCaps::default()),
                1 => Just(ClassCaps { max_concurrent: Some(1), ..ClassCaps::default() }),
            ], 2..=3))
                .prop_map(|(default, caps)| Some(Classes { default, caps })),
        ],
    )
        .prop_map(
            |(max_concurrent, max_queue, budget, dedup, classes)| Config {
                max_concurrent,
                max_queue,
                budget,
                initial_revision: 0,
                classes,
                dedup,
                rate: None,
            },
        )
        .boxed()
}

/// The requests of shared calls: `(model, characters, max_tokens)`, few of them, so that
/// identical calls are frequent. The first two differ only in `max_tokens` (one key by model,
/// two by request); the fourth has no model (an empty key by model), the fifth the model the
/// key function panics on.
const REQUESTS: [(u8, u32, Option<u64>); 5] = [
    (1, 40, Some(100)),
    (1, 40, Some(300)),
    (2, 120, None),
    (0, 80, Some(50)),
    (3, 40, Some(100)),
];

/// A call with one of [`REQUESTS`]: its priority and explicit reservation (not part of any
/// key) vary; its class is mostly the default one, often one of the bulkhead's (with classes),
/// rarely another bulkhead's.
fn shared_call(classes: bool) -> BoxedStrategy<Call> {
    let class = if classes {
        prop_oneof![10 => Just(0u8), 8 => 1..=3u8, 1 => Just(5u8)].boxed()
    } else {
        prop_oneof![30 => Just(0u8), 1 => Just(5u8)].boxed()
    };
    (
        call(),
        prop_oneof![4 => 0..3usize, 1 => 3..5usize],
        prop::bool::weighted(0.6),
        0..600u64,
        prop_oneof![4 => 0..1200u64, 1 => 1200..4000u64],
        class,
    )
        .prop_map(|(call, request, explicit, input, max_output, class)| {
            let (model, chars, max_tokens) = REQUESTS[request];
            Call {
                class,
                explicit,
                input,
                max_output,
                model,
                chars,
                has_max_tokens: max_tokens.is_some(),
                max_tokens: max_tokens.unwrap_or(0),
                has_extra_input: false,
                extra_input: 0,
                ..call
            }
        })
        .boxed()
}

/// An observe set (see `Op::Run`): mostly none, else any of them.
fn observe() -> impl Strategy<Value = u8> {
    prop_oneof![2 => Just(0u8), 3 => 1..6u8]
}

/// A call of a bulkhead with classes.
fn class_shared_call() -> BoxedStrategy<Call> {
    shared_call(true)
}

/// A call of a bulkhead without classes.
fn plain_shared_call() -> BoxedStrategy<Call> {
    shared_call(false)
}

/// The operations of a bulkhead with classes or without.
fn shared_op(classes: bool) -> BoxedStrategy<Op> {
    let index = any::<u32>;
    let shared_call = move || shared_call(classes);
    let others = if classes {
        op_using(class_shared_call).boxed()
    } else {
        op_using(plain_shared_call).boxed()
    };
    prop_oneof![
        24 => others,
        2 => any::<bool>().prop_map(|on| Op::AutoPoll { on }),
        8 => (
            shared_call(),
            timeout(),
            prop_oneof![6 => Just(0u8), 1 => Just(3u8)],
            prop::option::weighted(0.3, small_usage()),
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.2),
            observe(),
        )
            .prop_map(
                |(call, timeout, deadline, report_first, abandon_first, finish_first, observe)| {
                    Op::Run {
                        call,
                        timeout,
                        deadline,
                        report_first,
                        abandon_first,
                        finish_first,
                        observe,
                    }
                },
            ),
        2 => (index(), small_usage(), prop::option::weighted(0.3, (0..1500u64, 0..200u64)))
            .prop_map(|(run, (input, output), progressive)| Op::RunReport {
                run,
                input,
                output,
                progressive,
            }),
        1 => index().prop_map(|run| Op::RunAbandon { run }),
        3 => (index(), prop::bool::weighted(0.7), prop::option::weighted(0.6, small_usage()))
            .prop_map(|(run, ok, usage)| Op::RunFinish { run, ok, usage }),
        1 => index().prop_map(|run| Op::DropRun { run }),
        24 => (
            shared_call(),
            prop_oneof![6 => Just(0u8), 1 => 1..=2u8],
            prop::bool::weighted(0.08),
            prop_oneof![6 => Just(0u8), 3 => Just(1u8), 1 => Just(2u8)],
            observe(),
            prop::option::weighted(0.3, small_usage()),
            prop::bool::weighted(0.1),
            any::<bool>(),
        )
            .prop_map(
                |(call, scope, no_dedup, timeout, observe, report_first, finish_first, extract)| {
                    Op::Shared {
                        call,
                        scope,
                        no_dedup,
                        timeout,
                        observe,
                        report_first,
                        finish_first,
                        extract,
                    }
                },
            ),
        12 => (index(), index(), step()).prop_map(|(flight, via, step)| Op::SharedStep {
            flight,
            via,
            step,
        }),
        4 => index().prop_map(|caller| Op::DropShared { caller }),
        1 => index().prop_map(|caller| Op::PollShared { caller }),
    ]
    .boxed()
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (small_usage(), prop::option::weighted(0.3, (0..1500u64, 0..200u64))).prop_map(
            |((input, output), progressive)| Step::Report {
                input,
                output,
                progressive,
            }
        ),
        1 => Just(Step::Abandon),
        4 => (prop::bool::weighted(0.7), prop::option::weighted(0.6, small_usage()))
            .prop_map(|(ok, usage)| Step::Finish { ok, usage }),
    ]
}

proptest! {
    #![proptest_config(proptest_config(SHARED_CASES))]

    /// Deduplication and observe mode: any sequence of shared calls, runs in observe mode and
    /// the other operations.
    #[test]
    fn the_crate_agrees_with_the_model_on_shared_calls((config, ops) in shared_case()) {
        run(config, &ops);
    }
}

/// A configuration and operations for it.
fn shared_case() -> impl Strategy<Value = (Config, Vec<Op>)> {
    dedup_config().prop_flat_map(|config| {
        let classes = config.classes.is_some();
        (Just(config), vec(shared_op(classes), 10..=50))
    })
}

/// Cases of the shared family.
const SHARED_CASES: u32 = 600;

/// The random shared sequences reach every way of leading, following, leaving and bypassing.
#[test]
fn random_shared_sequences_reach_the_shared_cases() {
    assert_reached(shared_case(), 300, &EVERY_SHARED_CASE);
}

const EVERY_SHARED_CASE: [&str; 42] = [
    "observe: advisory bypass",
    "observe: bypass after a queue timeout",
    "observe: bypass dropped",
    "observe: bypass ended with usage",
    "observe: bypass holds no slot to abandon",
    "observe: bypass usage error",
    "observe: bypass usage reported",
    "observe: race bypass",
    "observe: refusal outside the set",
    "observe: shutdown not bypassed",
    "observe: stale bypass usage report",
    "run bypassed",
    "shared: alone after close",
    "shared: call admitted",
    "shared: call bypassed",
    "shared: call driven by a follower",
    "shared: call finished after its leader left",
    "shared: callback failed",
    "shared: empty key",
    "shared: failure shared with followers",
    "shared: followed",
    "shared: followed a bypassed call",
    "shared: followed a queued call",
    "shared: follower cancelled",
    "shared: follower timed out",
    "shared: follower timed out into a bypass",
    "shared: invalid class",
    "shared: key function panicked",
    "shared: last waiter left a queued call",
    "shared: last waiter left a running call",
    "shared: last waiter was a follower",
    "shared: leader left while followers wait",
    "shared: led",
    "shared: no deduplication configured",
    "shared: no_dedup",
    "shared: outcome dropped unread",
    "shared: queued call dropped",
    "shared: running call dropped",
    "shared: several followers",
    "shared: the same request led apart by its class",
    "shared: the same request led apart by its scope",
    "shared: value shared with followers",
];
