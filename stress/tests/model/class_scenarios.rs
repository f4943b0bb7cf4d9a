//! Deterministic scenarios with admission classes: upstream's worked examples (design §U6.5,
//! §U6.6, §U8.2) number for number, abandonment, the `run` deadline and the queue. Each runs
//! through the harness (so the crate agrees with the model at every step) and then pins the
//! model's figures to the ones the design states.

use crate::reference::{
    Call, ClassCaps, Classes, Config, Constraint, Harness, Op, Pool, Reason, Refused,
};
use crate::scenarios::{acquire, ask, release, scenario, try_acquire};

/// Class limits: `(floor, ceiling, token floor, token ceiling)`.
pub(crate) fn caps(
    floor: Option<u32>,
    max: Option<u32>,
    token_floor: Option<u64>,
    max_tokens: Option<u64>,
) -> ClassCaps {
    ClassCaps {
        protected_concurrent: floor,
        max_concurrent: max,
        protected_tokens: token_floor,
        max_tokens,
        rate: None,
    }
}

pub(crate) fn no_limits() -> ClassCaps {
    ClassCaps::default()
}

/// A bulkhead with `classes` (`premium`, `standard`, `batch`, ` spare `, in that order).
pub(crate) fn with_classes(
    max_concurrent: u32,
    max_queue: u32,
    budget: Option<(u64, u64)>,
    default: usize,
    classes: &[ClassCaps],
) -> Config {
    Config {
        max_concurrent,
        max_queue,
        budget,
        initial_revision: 0,
        classes: Some(Classes {
            default,
            caps: classes.to_vec(),
        }),
        dedup: None,
        rate: None,
    }
}

/// `call` in the bulkhead's class at position `class`.
pub(crate) fn in_class(class: u8, call: Call) -> Call {
    Call {
        class: class + 1,
        ..call
    }
}

/// New limits at the next revision with the class part `classes` (in construction order),
/// shaped and ordered as [`Op::ApplyLimits`] says.
pub(crate) fn class_limits(
    max_concurrent: u32,
    budget: Option<(u64, u64)>,
    shape: u8,
    order: u8,
    classes: &[ClassCaps],
) -> Op {
    let mut all: [ClassCaps; 4] = Default::default();
    all[..classes.len()].copy_from_slice(classes);
    let (budget, reserve) = budget.unwrap_or((0, 0));
    Op::ApplyLimits {
        revision_delta: 1,
        max_concurrent,
        max_queue: 0,
        flip_budget: false,
        budget,
        reserve,
        class_shape: shape,
        class_order: order,
        classes: all,
    }
}

fn run(call: Call, deadline: u8, report_first: Option<(u64, u64)>) -> Op {
    run_then(call, deadline, report_first, false, false)
}

/// A run whose callback, once called, reports `report_first`, then abandons its slot if
/// `abandon_first`, then finishes at once if `finish_first`.
fn run_then(
    call: Call,
    deadline: u8,
    report_first: Option<(u64, u64)>,
    abandon_first: bool,
    finish_first: bool,
) -> Op {
    Op::Run {
        call,
        timeout: 0,
        deadline,
        report_first,
        abandon_first,
        finish_first,
        observe: 0,
    }
}

/// The last refusal announced: its call's class and the refusal.
fn refusal(harness: &mut Harness) -> (Option<usize>, Refused) {
    harness
        .inspect(|m| m.last_refused)
        .expect("a refusal was announced")
}

#[test]
fn the_upstream_example_of_a_full_shared_pool() {
    // Design §U6.5: 4 slots, floors premium 2 / standard 1, so the shared pool holds 1 slot;
    // three premium calls are admitted (two within the floor, one borrowed), a fourth is
    // refused `concurrency_limit` / `admission_class_protection` with shared {1, 1, 0, 1}.
    let mut h = Harness::new(with_classes(
        4,
        0,
        None,
        1,
        &[
            caps(Some(2), None, None, None),
            caps(Some(1), None, None, None),
        ],
    ));
    for _ in 0..3 {
        h.apply(&try_acquire(in_class(0, ask(0, 0))));
    }
    let premium = h.inspect(|m| m.stats().classes.expect("classes").classes[0].clone());
    assert_eq!(premium.slots, (3, 2, 1));
    assert_eq!(premium.total_borrowed_admissions, 1);
    h.apply(&try_acquire(in_class(0, ask(0, 0))));
    let (class, refused) = refusal(&mut h);
    assert_eq!(class, Some(0));
    assert_eq!(refused.reason, Reason::ConcurrencyLimit);
    assert_eq!(
        refused.detail.constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    let (slots, tokens) = refused.detail.shared.expect("the shared pools");
    assert_eq!(
        slots,
        Pool {
            capacity: 1,
            in_use: 1,
            available: 0,
            requested_borrowed: 1
        }
    );
    assert_eq!(tokens, None);
    let class = refused.detail.class.expect("the class");
    assert_eq!(
        (
            class.in_flight,
            class.protected_concurrent,
            class.protected_concurrent_in_use,
            class.borrowed_concurrent,
            class.available_protected_concurrent,
            class.max_concurrent,
        ),
        (3, 2, 2, 1, 0, None)
    );
    // Standard's idle floor was never lent: its call is admitted, within its floor.
    h.apply(&try_acquire(ask(0, 0)));
    let stats = h.inspect(|m| m.stats());
    assert_eq!((stats.in_flight, stats.admitted, stats.rejected), (4, 4, 1));
    let classes = stats.classes.expect("classes");
    assert_eq!(classes.shared, (1, 1, 0));
    assert_eq!(classes.classes[1].slots, (1, 1, 0));
    assert_eq!(classes.classes[0].rejected_by_reason[1], 1);
    assert_eq!(classes.classes[1].rejected, 0);
    h.finish();
}

#[test]
fn the_upstream_example_of_a_full_shared_token_pool() {
    // Design §U6.5: budget 2000, token floors premium 400 / standard 800, so the shared pool
    // holds 800 tokens; three 400-token premium calls (the first within the floor, two
    // borrowed); the next is refused `budget_limit` / `admission_class_protection` with shared
    // tokens {800, 800, 0, 400}.
    let mut h = Harness::new(with_classes(
        8,
        0,
        Some((2000, 0)),
        1,
        &[
            caps(None, None, Some(400), None),
            caps(None, None, Some(800), None),
        ],
    ));
    for _ in 0..3 {
        h.apply(&try_acquire(in_class(0, ask(100, 300))));
    }
    let premium = h.inspect(|m| m.stats().classes.expect("classes").classes[0].clone());
    assert_eq!(premium.tokens, (1200, 400, 800));
    assert_eq!(premium.total_borrowed_tokens_reserved, 800);
    // No concurrency floor: every premium slot is borrowed.
    assert_eq!(premium.total_borrowed_admissions, 3);
    h.apply(&try_acquire(in_class(0, ask(100, 300))));
    let (_, refused) = refusal(&mut h);
    assert_eq!(refused.reason, Reason::BudgetLimit);
    assert_eq!(
        refused.detail.constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    let (_, tokens) = refused.detail.shared.expect("the shared pools");
    assert_eq!(
        tokens,
        Some(Pool {
            capacity: 800,
            in_use: 800,
            available: 0,
            requested_borrowed: 400
        })
    );
    let t = refused
        .detail
        .class
        .and_then(|c| c.tokens)
        .expect("the class's tokens");
    assert_eq!(
        (
            t.in_flight_tokens,
            t.protected_tokens,
            t.protected_tokens_in_use,
            t.borrowed_tokens,
            t.available_protected_tokens,
            t.max_tokens,
            t.available,
            t.requested,
        ),
        (1200, 400, 400, 800, 0, None, None, 400)
    );
    // The global budget had room: only standard's floor refused it.
    assert_eq!(refused.detail.tokens.expect("a budget").available, 800);
    // Standard's 800 protected tokens are there for it, borrowing nothing.
    h.apply(&try_acquire(ask(400, 400)));
    let classes = h.inspect(|m| m.stats().classes.expect("classes"));
    assert_eq!(classes.classes[1].total_borrowed_tokens_reserved, 0);
    assert_eq!(classes.shared_tokens, Some((800, 800, 0)));
    h.finish();
}

#[test]
fn the_upstream_example_of_class_limits_shrinking_under_a_call() {
    // Design §U6.6: premium set to {max_concurrent: 0, max_in_flight_tokens: 0} while one
    // premium call is in flight: applied, the call stays in flight, the next premium call is
    // refused `budget_limit` (the token ceiling is judged before the concurrency ceiling).
    let mut h = Harness::new(with_classes(
        4,
        0,
        Some((1000, 0)),
        1,
        &[no_limits(), no_limits()],
    ));
    h.apply(&Op::Listen { on: true });
    h.apply(&try_acquire(in_class(0, ask(10, 10))));
    h.apply(&class_limits(
        4,
        Some((1000, 0)),
        1,
        0,
        &[caps(None, Some(0), None, Some(0)), no_limits()],
    ));
    let premium = h.inspect(|m| m.stats().classes.expect("classes").classes[0].clone());
    assert_eq!((premium.slots.0, premium.tokens.0), (1, 20));
    h.apply(&try_acquire(in_class(0, ask(1, 1))));
    let (_, refused) = refusal(&mut h);
    assert_eq!(
        (refused.reason, refused.detail.constraint),
        (Reason::BudgetLimit, Some(Constraint::AdmissionClass))
    );
    // Once the call settled, a call of 0 tokens fits the token ceiling of 0 and meets the
    // concurrency ceiling of 0.
    h.apply(&release(0, Some((5, 5))));
    h.apply(&try_acquire(in_class(0, ask(0, 0))));
    let (_, refused) = refusal(&mut h);
    assert_eq!(
        (refused.reason, refused.detail.constraint),
        (Reason::ConcurrencyLimit, Some(Constraint::AdmissionClass))
    );
    let class = refused.detail.class.expect("the class");
    assert_eq!(
        (class.max_concurrent, class.available_concurrent),
        (Some(0), Some(0))
    );
    h.finish();
}

#[test]
fn an_abandoned_slot_serves_the_queue_and_its_tokens_settle_later() {
    // Design §U7.2, §U7.4: no floors (so a full bulkhead queues); batch (the default class)
    // borrows every slot. Abandoning returns the slot to the queue's head at once, the tokens
    // stay held until release, and drain waits for them.
    let mut h = Harness::new(with_classes(
        2,
        2,
        Some((1000, 0)),
        2,
        &[no_limits(), no_limits(), no_limits()],
    ));
    h.apply(&Op::Listen { on: true });
    h.apply(&try_acquire(ask(100, 200)));
    h.apply(&try_acquire(in_class(0, ask(10, 10))));
    h.apply(&acquire(ask(10, 10)));
    h.apply(&Op::Abandon { permit: 0 });
    let stats = h.inspect(|m| m.stats());
    assert_eq!(
        (
            stats.in_flight,
            stats.abandoned_in_flight,
            stats.pending,
            stats.abandoned
        ),
        (2, 1, 0, (1, 1, 0))
    );
    assert_eq!(stats.tokens.expect("a budget").in_flight_tokens, 340);
    h.apply(&Op::Abandon { permit: 0 });
    // Usage can still be reported; the hold moves, the slot stays given back.
    h.apply(&Op::ReportUsage {
        permit: 0,
        input: 100,
        output: 20,
    });
    h.apply(&Op::Drain {
        zero_timeout: false,
    });
    h.apply(&Op::Drain { zero_timeout: true });
    h.apply(&release(2, None));
    h.apply(&release(1, None));
    h.apply(&release(0, None));
    let batch = h.inspect(|m| m.stats().classes.expect("classes").classes[2].clone());
    assert_eq!(
        (
            batch.admitted,
            batch.released,
            batch.abandoned,
            batch.total_consumed
        ),
        (2, 2, (1, 1, 0), 120)
    );
    let tally = h.finish_with_tally();
    for (what, count) in [
        ("abandoned: manual", 1),
        ("abandoned slot served the queue", 1),
        ("abandon refused: already abandoned", 1),
        ("released an abandoned admission", 1),
        ("pending drain completed", 1),
    ] {
        assert_eq!(tally.get(what).copied().unwrap_or(0), count, "{what}");
    }
    // Within a floor, nothing to abandon.
    scenario(
        with_classes(
            2,
            0,
            None,
            1,
            &[caps(Some(1), None, None, None), no_limits()],
        ),
        &[
            try_acquire(in_class(0, ask(0, 0))),
            Op::Abandon { permit: 0 },
        ],
        &[("abandon refused: slot not borrowed", 1)],
    );
}

#[test]
fn the_borrowed_slot_deadline() {
    // Design §U7.3 (Q16): 2 slots, budget 1000; premium keeps a slot, batch (the default)
    // borrows.
    let tiers = || {
        with_classes(
            2,
            0,
            Some((1000, 0)),
            2,
            &[caps(Some(1), None, None, None), no_limits(), no_limits()],
        )
    };
    let mut h = Harness::new(tiers());
    h.apply(&Op::Listen { on: true });
    // Cut: the slot goes back (cause `deadline`), the tokens settle with the last usage.
    h.apply(&run(ask(100, 400), 2, Some((100, 50))));
    let stats = h.inspect(|m| m.stats());
    assert_eq!(
        (
            stats.in_flight,
            stats.abandoned_in_flight,
            stats.released,
            stats.abandoned
        ),
        (0, 0, 1, (1, 0, 1))
    );
    let tokens = stats.tokens.expect("a budget");
    assert_eq!((tokens.in_flight_tokens, tokens.total_consumed), (0, 150));
    assert_eq!(
        stats.classes.expect("classes").classes[2].abandoned,
        (1, 0, 1)
    );
    // Within premium's floor: never cut; it finishes when told.
    h.apply(&run(in_class(0, ask(10, 10)), 2, None));
    h.apply(&Op::RunFinish {
        run: 0,
        ok: true,
        usage: Some((5, 5)),
    });
    // A callback that finishes at once is never cut.
    h.apply(&run_then(ask(10, 10), 2, Some((1, 1)), false, true));
    // After the callback gave its slot back itself, the deadline no longer applies.
    h.apply(&run_then(ask(10, 10), 2, None, true, false));
    h.apply(&Op::RunReport {
        run: 0,
        input: 10,
        output: 3,
        progressive: None,
    });
    h.apply(&Op::RunFinish {
        run: 0,
        ok: false,
        usage: None,
    });
    // A long deadline that never passes; the callback fails.
    h.apply(&run(ask(10, 10), 3, None));
    h.apply(&Op::RunAbandon { run: 0 });
    h.apply(&Op::DropRun { run: 0 });
    let before = h.inspect(|m| m.stats());
    // A zero deadline is refused before anything happens, even for a foreign class.
    h.apply(&run(ask(10, 10), 1, None));
    h.apply(&run(in_class(4, ask(10, 10)), 1, None));
    assert_eq!(h.inspect(|m| m.stats()), before);
    let by_cause = before.abandoned;
    assert_eq!(by_cause, (3, 2, 1));
    let tally = h.finish_with_tally();
    for (what, count) in [
        ("deadline passed", 1),
        ("run deadline not applied: slot within the floor", 1),
        ("run finished first under a deadline", 1),
        ("run deadline not applied", 1),
        ("run: zero deadline refused", 2),
        ("run finished", 1),
        ("run failed", 1),
        ("run dropped while running", 1),
    ] {
        assert_eq!(tally.get(what).copied().unwrap_or(0), count, "{what}");
    }
}

#[test]
fn a_run_waits_in_the_queue_then_is_cut_at_its_deadline() {
    // The deadline runs from admission on (design §U7.3): a run that waited is cut once it
    // is handed a borrowed slot, and its slot goes to the next waiter.
    let mut h = Harness::new(with_classes(1, 2, None, 0, &[no_limits()]));
    h.apply(&try_acquire(ask(0, 0)));
    h.apply(&run(ask(0, 0), 2, None));
    h.apply(&acquire(ask(0, 0)));
    h.apply(&release(0, None));
    // The waiter was polled before the run was cut: it picks its hand-off up now.
    h.apply(&Op::PollWaiter { waiter: 0 });
    let stats = h.inspect(|m| m.stats());
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.abandoned
        ),
        (1, 0, 3, (1, 0, 1))
    );
    h.finish();
}

#[test]
fn a_queue_head_refused_by_its_class_passes_the_turn_on() {
    // Design §U6.4: one FIFO queue for every class; at its turn a head whose class no longer
    // fits is refused with the class reason and the next waiter gets the slot.
    let mut h = Harness::new(with_classes(1, 4, None, 0, &[no_limits(), no_limits()]));
    h.apply(&try_acquire(in_class(1, ask(0, 0))));
    h.apply(&acquire(in_class(0, ask(0, 0))));
    h.apply(&acquire(in_class(1, ask(0, 0))));
    h.apply(&class_limits(
        1,
        None,
        1,
        0,
        &[caps(None, Some(0), None, None), no_limits()],
    ));
    h.apply(&release(0, None));
    let (class, refused) = refusal(&mut h);
    assert_eq!(class, Some(0));
    assert_eq!(
        (refused.reason, refused.detail.constraint),
        (Reason::ConcurrencyLimit, Some(Constraint::AdmissionClass))
    );
    assert_eq!(refused.detail.pending, 1);
    let stats = h.inspect(|m| m.stats());
    let classes = stats.classes.expect("classes");
    assert_eq!(
        (classes.classes[0].admitted, classes.classes[0].rejected),
        (0, 1)
    );
    assert_eq!(
        (classes.classes[1].admitted, classes.classes[1].slots.0),
        (2, 1)
    );
    let tally = h.finish_with_tally();
    assert_eq!(tally.get("queue head refused by its class"), Some(&1));
    assert_eq!(tally.get("handed a slot"), Some(&1));
}

#[test]
fn a_floor_raised_over_borrowed_slots_is_not_a_guaranteed_slot() {
    // Design §U6.4: premium borrows both slots; standard then gets a floor of 2. A standard
    // call is within its floor (no protection) but finds no global slot.
    let mut h = Harness::new(with_classes(2, 0, None, 1, &[no_limits(), no_limits()]));
    h.apply(&try_acquire(in_class(0, ask(0, 0))));
    h.apply(&try_acquire(in_class(0, ask(0, 0))));
    h.apply(&class_limits(
        2,
        None,
        1,
        0,
        &[no_limits(), caps(Some(2), None, None, None)],
    ));
    h.apply(&try_acquire(ask(0, 0)));
    let (_, refused) = refusal(&mut h);
    assert_eq!(
        (refused.reason, refused.detail.constraint),
        (Reason::ConcurrencyLimit, Some(Constraint::Global))
    );
    assert_eq!(
        refused.detail.shared.expect("the pools").0,
        Pool {
            capacity: 0,
            in_use: 2,
            available: 0,
            requested_borrowed: 0
        }
    );
    h.apply(&release(0, None));
    h.apply(&release(0, None));
    // Attrition done: standard's floor is its own, premium (no floor) borrows from nothing.
    h.apply(&try_acquire(ask(0, 0)));
    h.apply(&try_acquire(in_class(0, ask(0, 0))));
    let (class, refused) = refusal(&mut h);
    assert_eq!(class, Some(0));
    assert_eq!(
        refused.detail.constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    let tally = h.finish_with_tally();
    assert_eq!(
        tally.get("refused: global concurrency within a floor"),
        Some(&1)
    );
}

#[test]
fn another_bulkheads_class_changes_nothing() {
    // Design §U6.2: refused before anything is counted.
    let mut h = Harness::new(with_classes(2, 1, Some((1000, 0)), 0, &[no_limits()]));
    for op in [
        try_acquire(in_class(4, ask(1, 1))),
        acquire(in_class(5, ask(1, 1))),
        Op::WouldAdmit {
            with_detail: true,
            call: in_class(6, ask(1, 1)),
        },
        run(in_class(7, ask(1, 1)), 0, None),
    ] {
        h.apply(&op);
    }
    let stats = h.inspect(|m| m.stats());
    assert_eq!((stats.admitted, stats.rejected), (0, 0));
    // `would_admit` answers the same error (compared by the harness, not tallied).
    assert_eq!(
        h.finish_with_tally().get("invalid request: foreign class"),
        Some(&3)
    );
    let mut h = Harness::new(crate::scenarios::config(2, 1, None));
    h.apply(&try_acquire(in_class(0, ask(1, 1))));
    assert_eq!(
        h.finish_with_tally()
            .get("invalid request: classes not configured"),
        Some(&1)
    );
}
