//! Deterministic scenarios that pin the tricky cases.

use async_bulkhead_llm::{limits::MAX_BUDGET, limits::MAX_REVISION};

use crate::proptests::run;
use crate::reference::{Call, Config, Op};

/// An explicit reservation of `input + max_output` tokens, normal priority.
pub(crate) fn ask(input: u64, max_output: u64) -> Call {
    Call {
        class: 0,
        high: false,
        explicit: true,
        input,
        max_output,
        model: 0,
        chars: 0,
        has_max_tokens: false,
        max_tokens: 0,
        has_extra_input: false,
        extra_input: 0,
    }
}

pub(crate) fn high(call: Call) -> Call {
    Call { high: true, ..call }
}

pub(crate) fn try_acquire(call: Call) -> Op {
    Op::TryAcquire { owned: false, call }
}

/// An acquire without timeout, polled once and kept if it waits.
pub(crate) fn acquire(call: Call) -> Op {
    Op::Acquire {
        owned: true,
        timeout: 0,
        call,
    }
}

pub(crate) fn release(permit: u32, usage: Option<(u64, u64)>) -> Op {
    let (input, output) = usage.unwrap_or((0, 0));
    Op::Release {
        permit,
        with_usage: usage.is_some(),
        input,
        output,
    }
}

pub(crate) fn limits(
    revision_delta: i64,
    max_concurrent: u32,
    max_queue: u32,
    budget: (u64, u64),
) -> Op {
    Op::ApplyLimits {
        revision_delta,
        max_concurrent,
        max_queue,
        flip_budget: false,
        budget: budget.0,
        reserve: budget.1,
        class_shape: 0,
        class_order: 0,
        classes: Default::default(),
    }
}

pub(crate) fn config(max_concurrent: u32, max_queue: u32, budget: Option<(u64, u64)>) -> Config {
    Config {
        max_concurrent,
        max_queue,
        budget,
        initial_revision: 0,
        classes: None,
        dedup: None,
        rate: None,
    }
}

/// Runs a scenario and checks that each situation it is about happened as often as stated.
pub(crate) fn scenario(config: Config, ops: &[Op], expected: &[(&str, u64)]) {
    let tally = run(config, ops);
    for &(what, count) in expected {
        assert_eq!(
            tally.get(what).copied().unwrap_or(0),
            count,
            "how often {what:?} happened; everything: {tally:#?}"
        );
    }
}

#[test]
fn fifo_hand_off_with_tokens() {
    // One slot, budget 1000. The holder releases: the head takes its slot and its 300 tokens
    // in one step; at the next release the second waiter does.
    scenario(
        config(1, 3, Some((1000, 0))),
        &[
            Op::Listen { on: true },
            try_acquire(ask(100, 400)),
            acquire(ask(0, 300)),
            acquire(ask(0, 200)),
            // A newcomer never passes the waiters, even with tokens to spare.
            try_acquire(ask(0, 1)),
            release(0, Some((50, 100))),
            release(0, None),
            release(0, Some((0, 0))),
        ],
        &[
            ("queued", 2),
            ("handed a slot and tokens", 2),
            ("refused: concurrency_limit", 1),
        ],
    );
}

#[test]
fn a_head_refused_for_its_tokens_passes_the_turn_on() {
    // The budget shrinks while two wait; the head keeps its place until a slot frees, then
    // is refused `budget_limit` and the next waiter, whose tokens fit, gets the slot.
    scenario(
        config(1, 3, Some((1000, 0))),
        &[
            try_acquire(ask(100, 200)),
            acquire(ask(0, 600)),
            acquire(ask(0, 100)),
            Op::SetBudget { tokens: 500 },
            release(0, None),
        ],
        &[
            ("queue head refused for its tokens", 1),
            ("refused: budget_limit", 1),
            ("handed a slot and tokens", 1),
        ],
    );
}

#[test]
fn the_upstream_example_of_limits_refusing_a_queued_call() {
    // Design §U8.2, its example: 400 of 1000 tokens in flight and one call queued; revision 8
    // raises concurrency but shrinks the budget to 500 (reserve 100): the queued call is
    // refused `budget_limit` against revision 8, and 400 tokens stay in flight.
    scenario(
        Config {
            max_concurrent: 1,
            max_queue: 1,
            budget: Some((1000, 0)),
            initial_revision: 7,
            classes: None,
            dedup: None,
            rate: None,
        },
        &[
            try_acquire(ask(0, 400)),
            acquire(ask(100, 500)),
            limits(1, 2, 3, (500, 100)),
        ],
        &[
            ("limits changed while calls wait", 1),
            ("queue head refused for its tokens", 1),
        ],
    );
}

#[test]
fn close_refuses_every_waiter() {
    scenario(
        config(1, 3, None),
        &[
            try_acquire(ask(0, 0)),
            acquire(ask(0, 0)),
            acquire(ask(0, 0)),
            Op::Drain {
                zero_timeout: false,
            },
            Op::Close,
            // Closed is checked before any capacity (Q1): shutdown, not a full queue.
            acquire(ask(0, 0)),
            Op::WouldAdmit {
                with_detail: true,
                call: ask(0, 0),
            },
            Op::Close,
            release(0, None),
        ],
        &[
            ("waiter refused by close", 2),
            ("refused: shutdown", 3),
            ("pending drain completed", 1),
        ],
    );
}

#[test]
fn a_hand_off_made_before_close_is_still_admitted() {
    scenario(
        config(1, 2, Some((1000, 0))),
        &[
            Op::AutoPoll { on: false },
            try_acquire(ask(0, 10)),
            acquire(ask(0, 20)),
            acquire(ask(0, 30)),
            release(0, None),
            Op::Close,
            Op::AutoPoll { on: true },
        ],
        &[
            ("handed a slot and tokens", 1),
            ("waiter refused by close", 1),
            ("hand-off picked up after close", 1),
        ],
    );
}

#[test]
fn raised_limits_serve_the_waiters_in_order() {
    scenario(
        config(1, 4, None),
        &[
            try_acquire(ask(0, 0)),
            acquire(ask(0, 0)),
            acquire(ask(0, 0)),
            acquire(ask(0, 0)),
            // Two more slots: the first two waiters get them at once, the third keeps waiting.
            limits(1, 3, 4, (0, 0)),
            // The kill switch: nobody new gets in or queues; the waiter is kept...
            limits(1, 0, 4, (0, 0)),
            acquire(ask(0, 0)),
            release(0, None),
            // ...and served when concurrency comes back (two slots are still held).
            limits(1, 3, 4, (0, 0)),
            // A stale snapshot changes nothing.
            limits(0, 9, 9, (0, 0)),
        ],
        &[
            ("handed a slot", 3),
            ("limits changed while calls wait", 3),
            ("refused: concurrency_limit", 1),
            ("stale limits", 1),
        ],
    );
}

#[test]
fn cancelling_after_a_hand_off_passes_the_slot_on() {
    // Without re-polling, the hand-off sits in the waiter: a slot and 300 tokens in flight
    // that are not yet an admission. Dropping the waiter then counts `aborted` and hands the
    // slot and tokens on to the next waiter.
    scenario(
        config(1, 3, Some((1000, 0))),
        &[
            Op::AutoPoll { on: false },
            try_acquire(ask(0, 500)),
            acquire(ask(0, 300)),
            acquire(ask(0, 400)),
            release(0, Some((0, 200))),
            Op::CancelWaiter { waiter: 0 },
            Op::PollWaiter { waiter: 0 },
            release(0, None),
        ],
        &[
            ("handed a slot", 2),
            ("cancelled after a hand-off", 1),
            ("refused: aborted", 0),
        ],
    );
}

#[test]
fn cancelling_after_a_refusal_counts_it_once() {
    scenario(
        config(1, 3, Some((1000, 0))),
        &[
            Op::AutoPoll { on: false },
            Op::Listen { on: true },
            try_acquire(ask(0, 100)),
            acquire(ask(0, 800)),
            Op::SetBudget { tokens: 200 },
            release(0, None),
            Op::CancelWaiter { waiter: 0 },
        ],
        &[
            ("queue head refused for its tokens", 1),
            ("cancelled after a refusal", 1),
        ],
    );
}

#[test]
fn a_progressive_report_drives_the_hold_to_zero_then_release_books_the_usage() {
    // Q3: usage reaches `total_consumed` even when the hold is 0; the final usage re-holds
    // the tokens it consumed below the reservation, so the identity holds.
    scenario(
        config(2, 0, Some((5000, 0))),
        &[
            try_acquire(ask(100, 1000)),
            Op::ReportProgressive {
                permit: 0,
                input: 100,
                output: 1000,
                remaining: 0,
                margin: 0,
            },
            release(0, Some((100, 1000))),
            // The worked examples of design §U4.3: 950, then 650, then a rise back to 1500.
            try_acquire(ask(100, 1000)),
            Op::ReportProgressive {
                permit: 0,
                input: 20,
                output: 100,
                remaining: 900,
                margin: 50,
            },
            Op::ReportProgressive {
                permit: 0,
                input: 20,
                output: 400,
                remaining: 600,
                margin: 50,
            },
            Op::ReportUsage {
                permit: 0,
                input: 100,
                output: 1400,
            },
            // Stale: changes nothing.
            Op::ReportUsage {
                permit: 0,
                input: 10,
                output: 10,
            },
            release(0, None),
        ],
        &[
            ("hold driven to zero", 1),
            ("settled a hold of zero with usage", 1),
            ("tokens re-held", 2),
            ("overrun booked", 1),
            ("stale usage report", 1),
            ("token identity checked", 1),
        ],
    );
}

#[test]
fn usage_errors_change_nothing() {
    scenario(
        config(2, 0, Some((MAX_BUDGET, 0))),
        &[
            try_acquire(ask(10, 100)),
            Op::ReportProgressive {
                permit: 0,
                input: 1,
                output: 1,
                remaining: 101,
                margin: 0,
            },
            Op::ReportUsage {
                permit: 0,
                input: u64::MAX,
                output: 0,
            },
            Op::ReportUsage {
                permit: 0,
                input: 0,
                output: 1,
            },
            Op::ReportUsage {
                permit: 0,
                input: u64::MAX,
                output: 0,
            },
            Op::ReportUsage {
                permit: 0,
                input: MAX_BUDGET,
                output: 0,
            },
            Op::ReportProgressive {
                permit: 0,
                input: 0,
                output: 0,
                remaining: 100,
                margin: u64::MAX,
            },
            release(0, Some((u64::MAX, 1))),
            release(0, Some((u64::MAX - 1, 1))),
        ],
        &[
            ("usage error: remaining exceeds cap", 1),
            ("usage error: clamped total overflows", 1),
            ("usage error: hold overflows", 3),
        ],
    );
}

#[test]
fn the_high_priority_reserve() {
    // Design §U5, its example: B=2400, R=400: one 1100 request fits, a second is refused for
    // normal priority (effective 2000, available 900) and admitted for high.
    scenario(
        config(4, 0, Some((2400, 400))),
        &[
            try_acquire(ask(100, 1000)),
            Op::WouldAdmit {
                with_detail: true,
                call: ask(100, 1000),
            },
            try_acquire(ask(100, 1000)),
            try_acquire(high(ask(100, 1000))),
            Op::SetBudget { tokens: 300 },
            try_acquire(high(ask(0, 0))),
        ],
        &[
            ("refused: budget_limit", 2),
            ("admitted into the high-priority reserve", 1),
        ],
    );
}

#[test]
fn zero_timeouts_and_drains() {
    // Q5: a drain completes when the last waiter leaves by cancellation under the kill switch.
    scenario(
        config(1, 2, None),
        &[
            try_acquire(ask(0, 0)),
            Op::Acquire {
                owned: false,
                timeout: 1,
                call: ask(0, 0),
            },
            Op::Acquire {
                owned: false,
                timeout: 2,
                call: ask(0, 0),
            },
            limits(1, 0, 2, (0, 0)),
            release(0, None),
            Op::Drain { zero_timeout: true },
            Op::Drain {
                zero_timeout: false,
            },
            Op::CancelWaiter { waiter: 0 },
            Op::Drain { zero_timeout: true },
        ],
        &[
            ("refused: timeout", 1),
            ("cancelled while queued", 1),
            ("pending drain completed", 1),
        ],
    );
}

#[test]
fn estimates_and_invalid_requests() {
    let estimated = |model, chars, max_tokens: Option<u64>, extra: Option<u64>| Call {
        explicit: false,
        model,
        chars,
        has_max_tokens: max_tokens.is_some(),
        max_tokens: max_tokens.unwrap_or(0),
        has_extra_input: extra.is_some(),
        extra_input: extra.unwrap_or(0),
        ..ask(0, 0)
    };
    let calls = [
        estimated(0, 401, None, None),
        estimated(1, 370, Some(100), None),
        estimated(2, 39, Some(0), Some(7)),
        estimated(3, 1000, Some(u64::MAX), None),
        estimated(0, 9, None, Some(u64::MAX)),
        ask(u64::MAX, 1),
    ];
    for budget in [None, Some((1_000_000, 0))] {
        let mut ops = Vec::new();
        for call in &calls {
            ops.push(Op::Estimate { call: call.clone() });
            ops.push(try_acquire(call.clone()));
            ops.push(Op::WouldAdmit {
                with_detail: false,
                call: call.clone(),
            });
        }
        let tally = run(config(8, 0, budget), &ops);
        let invalid = if budget.is_some() { 2 } else { 0 };
        assert_eq!(tally.get("invalid request").copied().unwrap_or(0), invalid);
        // `estimate()` takes no reservation, so only `try_acquire` and `would_admit` build it.
        assert_eq!(tally.get("invalid explicit reservation"), Some(&2));
    }
}

#[test]
fn out_of_range_configurations_are_refused_then_clamped() {
    for config in [
        Config {
            max_concurrent: u32::MAX,
            max_queue: u32::MAX,
            budget: Some((u64::MAX, u64::MAX)),
            initial_revision: u64::MAX,
            classes: None,
            dedup: None,
            rate: None,
        },
        Config {
            max_concurrent: 1,
            max_queue: 0,
            budget: Some((MAX_BUDGET + 1, 0)),
            initial_revision: MAX_REVISION,
            classes: None,
            dedup: None,
            rate: None,
        },
        Config {
            max_concurrent: 1,
            max_queue: 0,
            budget: Some((10, 11)),
            initial_revision: 0,
            classes: None,
            dedup: None,
            rate: None,
        },
    ] {
        run(
            config,
            &[
                Op::SetBudget { tokens: 5 },
                limits(1, 1, 1, (1, 1)),
                try_acquire(ask(0, 1)),
            ],
        );
    }
}
