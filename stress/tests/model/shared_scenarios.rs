//! Deterministic scenarios of deduplication and observe mode (crate run_shared.rs, run.rs,
//! options.rs, observe.rs), each pinning its figures: who leads and who follows, what each
//! caller gets, and what is counted (`admitted`, the rejections by reason, the shared calls in
//! flight and the joins, the bypasses).

use std::future::Future;
use std::task::{Context, Waker};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, dedup::Deduplication,
};

use crate::reference::{Call, Config, DedupKind, Harness, Op, Step};
use crate::scenarios::{ask, release, try_acquire};

/// The model's figures after a scenario (the crate agreed with them at every step).
#[derive(Debug, PartialEq, Eq)]
struct Figures {
    admitted: u64,
    /// By reason, in the crate's order: shutdown, concurrency, budget, queue, timeout, aborted.
    rejected: [u64; 7],
    /// `(active, hits)`.
    dedup: (u64, u64),
    /// `(bypassed, race_bypassed, usage_reported, input tokens, output tokens)`.
    observe: (u64, u64, u64, u64, u64),
    consumed: u128,
}

/// Runs `ops` (listening to every event) and answers the figures before `finish`, and how
/// often each situation happened.
fn figures(config: Config, ops: &[Op]) -> (Figures, std::collections::BTreeMap<&'static str, u64>) {
    let mut harness = Harness::new(config);
    harness.apply(&Op::Listen { on: true });
    for op in ops {
        harness.apply(op);
    }
    let figures = harness.inspect(|m| {
        let o = m.observe;
        Figures {
            admitted: m.admitted,
            rejected: m.rejected,
            dedup: (m.flights.active(), m.flights.hits),
            observe: (
                o.bypassed,
                o.race_bypassed,
                o.usage_reported,
                o.input_tokens,
                o.output_tokens,
            ),
            consumed: m.consumed,
        }
    });
    (figures, harness.finish_with_tally())
}

fn dedup_config(max_concurrent: u32, max_queue: u32, budget: Option<(u64, u64)>) -> Config {
    Config {
        max_concurrent,
        max_queue,
        budget,
        initial_revision: 0,
        classes: None,
        dedup: Some(DedupKind::ByRequest),
        rate: None,
    }
}

/// `run_shared` of `call` (every `ask` is the same request), settling with its value's usage.
fn shared(call: Call) -> Op {
    shared_with(call, Shape::default())
}

/// The options of a shared call (see `Op::Shared`).
#[derive(Default)]
struct Shape {
    scope: u8,
    no_dedup: bool,
    timeout: u8,
    observe: u8,
}

fn shared_with(call: Call, shape: Shape) -> Op {
    Op::Shared {
        call,
        scope: shape.scope,
        no_dedup: shape.no_dedup,
        timeout: shape.timeout,
        observe: shape.observe,
        report_first: None,
        finish_first: false,
        extract: true,
    }
}

/// The callback of running shared call `flight` finishes, polled through its waiter `via`.
fn finish(flight: u32, via: u32, ok: bool, usage: Option<(u64, u64)>) -> Op {
    Op::SharedStep {
        flight,
        via,
        step: Step::Finish { ok, usage },
    }
}

/// A `run` in observe mode (`observe` as in `Op::Run`), with a queue timeout (`timeout` as in
/// `Op::Acquire`).
fn observed(call: Call, observe: u8, timeout: u8) -> Op {
    Op::Run {
        call,
        timeout,
        deadline: 0,
        report_first: None,
        abandon_first: false,
        finish_first: false,
        observe,
    }
}

const NONE: [u64; 7] = [0; 7];

#[test]
fn followers_share_the_leaders_admission_and_value() {
    // One admission for three callers: the followers take no capacity and are not counted;
    // the call settles once, with the usage of its value, finished through a follower's poll.
    let (figures, tally) = figures(
        dedup_config(2, 2, Some((10_000, 0))),
        &[
            shared(ask(100, 400)),
            shared(ask(0, 9000)),
            shared(ask(7, 7)),
            finish(0, 2, true, Some((30, 70))),
        ],
    );
    assert_eq!(
        figures,
        Figures {
            admitted: 1,
            rejected: NONE,
            dedup: (0, 2),
            observe: (0, 0, 0, 0, 0),
            consumed: 100,
        }
    );
    assert_eq!(tally["shared: led"], 1);
    assert_eq!(tally["shared: followed"], 2);
    assert_eq!(tally["shared: value shared with followers"], 1);
    assert_eq!(tally["shared: call driven by a follower"], 1);
}

#[test]
fn a_failed_leader_fails_every_follower_with_its_error() {
    let (figures, tally) = figures(
        dedup_config(1, 1, None),
        &[
            shared(ask(0, 0)),
            shared(ask(0, 0)),
            finish(0, 0, false, None),
        ],
    );
    assert_eq!(
        (figures.admitted, figures.rejected, figures.dedup),
        (1, NONE, (0, 1))
    );
    assert_eq!(tally["shared: failure shared with followers"], 1);
}

#[test]
fn a_follower_that_times_out_leaves_the_call_going() {
    // A follower's own zero timeout: counted as `timeout` (and nothing else), the call goes on
    // for the leader; the shared call stays registered until it finishes.
    let (figures, tally) = figures(
        dedup_config(1, 1, None),
        &[
            shared(ask(0, 0)),
            shared_with(
                ask(0, 0),
                Shape {
                    timeout: 1,
                    ..Shape::default()
                },
            ),
        ],
    );
    assert_eq!(figures.admitted, 1);
    assert_eq!(figures.rejected, [0, 0, 0, 0, 1, 0, 0]);
    assert_eq!(figures.dedup, (1, 1));
    assert_eq!(tally["shared: follower timed out"], 1);
    // `finish` dropped the leader, the last waiter: its call settled.
    assert_eq!(tally["shared: last waiter left a running call"], 1);
}

#[test]
fn a_follower_drives_the_call_after_its_leader_left() {
    // The leader's future is dropped while a follower waits: the call goes on, and finishes
    // when the follower polls it; a call joining meanwhile still follows it.
    let (figures, tally) = figures(
        dedup_config(1, 1, None),
        &[
            shared(ask(0, 0)),
            shared(ask(0, 0)),
            Op::DropShared { caller: 0 },
            shared(ask(0, 0)),
            finish(0, 0, true, None),
        ],
    );
    assert_eq!(
        (figures.admitted, figures.rejected, figures.dedup),
        (1, NONE, (0, 2))
    );
    assert_eq!(tally["shared: leader left while followers wait"], 1);
    assert_eq!(tally["shared: call finished after its leader left"], 1);
    assert_eq!(tally["shared: call driven by a follower"], 1);
}

#[test]
fn the_last_waiter_leaving_drops_the_call() {
    // A queued shared call: the follower's drop counts `aborted`; the leader's, the last
    // waiter's, drops the call, which leaves the queue (counted `aborted` too). A running
    // one: the last waiter's drop settles its admission.
    let (figures, tally) = figures(
        dedup_config(1, 2, None),
        &[
            try_acquire(ask(0, 0)),
            shared(ask(0, 0)),
            shared(ask(0, 0)),
            Op::DropShared { caller: 1 },
            Op::DropShared { caller: 0 },
            release(0, None),
            shared(ask(0, 0)),
            shared(ask(0, 0)),
            Op::DropShared { caller: 0 },
            Op::DropShared { caller: 0 },
        ],
    );
    assert_eq!(figures.admitted, 2);
    assert_eq!(figures.rejected, [0, 0, 0, 0, 0, 3, 0]);
    assert_eq!(figures.dedup, (0, 2));
    assert_eq!(tally["shared: last waiter left a queued call"], 1);
    assert_eq!(tally["shared: last waiter left a running call"], 1);
    assert_eq!(tally["shared: last waiter was a follower"], 1);
}

#[test]
fn scopes_no_dedup_and_close_keep_identical_calls_apart() {
    // The same request in another scope, with `no_dedup`, or after `close` never joins: each
    // leads or runs alone (and after close is refused `shutdown`).
    let (figures, tally) = figures(
        dedup_config(4, 0, None),
        &[
            shared(ask(0, 0)),
            shared_with(
                ask(0, 0),
                Shape {
                    scope: 1,
                    ..Shape::default()
                },
            ),
            shared_with(
                ask(0, 0),
                Shape {
                    no_dedup: true,
                    ..Shape::default()
                },
            ),
            Op::Close,
            shared(ask(0, 0)),
        ],
    );
    assert_eq!(figures.admitted, 3);
    assert_eq!(figures.rejected, [1, 0, 0, 0, 0, 0, 0]);
    assert_eq!(figures.dedup, (2, 0));
    assert_eq!(tally["shared: the same request led apart by its scope"], 1);
    assert_eq!(tally["shared: no_dedup"], 1);
    assert_eq!(tally["shared: alone after close"], 1);
}

#[test]
fn an_advisory_bypass_is_not_a_rejection() {
    // 1,500 tokens against a budget of 1,000: predicted, so bypassed at once, holding nothing;
    // its usage report is validated and counted when it ends.
    let (figures, tally) = figures(
        dedup_config(1, 1, Some((1000, 0))),
        &[
            observed(ask(900, 600), 1, 0),
            Op::RunReport {
                run: 0,
                input: 900,
                output: 20,
                progressive: None,
            },
            Op::RunFinish {
                run: 0,
                ok: true,
                usage: Some((900, 50)),
            },
        ],
    );
    assert_eq!(figures.admitted, 0);
    assert_eq!(figures.rejected, NONE);
    assert_eq!(figures.observe, (1, 0, 1, 900, 50));
    assert_eq!(tally["observe: advisory bypass"], 1);
}

#[test]
fn a_refusal_after_the_advisory_said_queue_is_counted_then_bypassed() {
    // The only slot is held: the advisory says "queue"; the zero queue timeout then refuses
    // the call (`timeout`, counted), and it runs as a race bypass. A head refused for its
    // tokens at its turn is bypassed the same way (`budget_limit`).
    let (figures, tally) = figures(
        dedup_config(1, 2, Some((1000, 0))),
        &[
            try_acquire(ask(0, 100)),
            observed(ask(0, 100), 3, 1),
            observed(ask(0, 600), 2, 0),
            Op::SetBudget { tokens: 500 },
            release(0, None),
        ],
    );
    assert_eq!(figures.admitted, 1);
    assert_eq!(figures.rejected, [0, 0, 1, 0, 1, 0, 0]);
    assert_eq!(figures.observe, (2, 2, 0, 0, 0));
    assert_eq!(tally["observe: race bypass"], 2);
    assert_eq!(tally["observe: bypass after a queue timeout"], 1);
    assert_eq!(tally["observe: bypass after a refusal"], 1);
}

#[test]
fn shutdown_and_reasons_outside_the_set_are_never_bypassed() {
    let (figures, tally) = figures(
        dedup_config(0, 0, Some((1000, 0))),
        &[
            // Concurrency is predicted, but only budget is in the set.
            observed(ask(0, 0), 2, 0),
            Op::Close,
            observed(ask(0, 0), 1, 0),
        ],
    );
    assert_eq!(figures.rejected, [1, 1, 0, 0, 0, 0, 0]);
    assert_eq!(figures.observe, (0, 0, 0, 0, 0));
    assert_eq!(tally["observe: refusal outside the set"], 1);
    assert_eq!(tally["observe: shutdown not bypassed"], 1);
}

#[test]
fn a_follower_in_observe_mode_runs_its_own_bypass_after_its_timeout() {
    // Its own zero timeout passes: the `timeout` is counted, then its own callback runs as a
    // bypass (no detail, not a race), while the leader's call goes on.
    let (figures, tally) = figures(
        dedup_config(1, 1, Some((1000, 0))),
        &[
            shared(ask(0, 100)),
            shared_with(
                ask(0, 100),
                Shape {
                    timeout: 1,
                    observe: 3,
                    ..Shape::default()
                },
            ),
            finish(1, 0, true, Some((4, 5))),
        ],
    );
    assert_eq!(figures.admitted, 1);
    assert_eq!(figures.rejected, [0, 0, 0, 0, 1, 0, 0]);
    assert_eq!(figures.dedup, (1, 1));
    assert_eq!(figures.observe, (1, 0, 1, 4, 5));
    assert_eq!(tally["shared: follower timed out into a bypass"], 1);
}

#[test]
fn keys_by_a_key_function_opt_out_when_empty_or_panicking() {
    // By model name: two requests of one model share whatever else differs; no model (an
    // empty key) and the model the function panics on run alone, the panic counted.
    let config = Config {
        dedup: Some(DedupKind::ByModel),
        rate: None,
        ..dedup_config(4, 0, None)
    };
    let with_model = |model, chars| Call {
        model,
        chars,
        ..ask(0, 0)
    };
    let mut harness = Harness::new(config);
    for op in [
        shared(with_model(1, 10)),
        shared(with_model(1, 20)),
        shared(with_model(0, 10)),
        shared(with_model(0, 10)),
        shared(with_model(3, 10)),
    ] {
        harness.apply(&op);
    }
    let figures = harness.inspect(|m| {
        (
            m.admitted,
            m.flights.active(),
            m.flights.hits,
            m.flights.key_panics,
        )
    });
    assert_eq!(figures, (4, 1, 1, 1));
    harness.finish();
}

/// A follower joins when `run_shared` is called (counted in `hits`), so dropping its future
/// ends its wait even before it was first polled: counted as `aborted`, like a follower
/// dropped while it waits.
#[test]
fn a_follower_dropped_before_its_first_poll_is_counted_as_aborted() {
    let bulkhead = LlmBulkhead::builder("m", 1)
        .deduplication(Deduplication::new())
        .build()
        .expect("a bulkhead");
    let request = LlmRequest::new().user("hi");
    let call = |_ctx| std::future::pending::<Result<u8, u8>>();
    let mut leader = Box::pin(bulkhead.run_shared(&request, AcquireOptions::new(), call));
    assert!(
        leader
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_pending()
    );
    drop(bulkhead.run_shared(&request, AcquireOptions::new(), call));
    let stats = bulkhead.stats();
    assert_eq!(stats.deduplication.map(|d| d.hits), Some(1));
    assert_eq!(stats.rejected_by_reason.get(RejectReason::Aborted), 1);
}
