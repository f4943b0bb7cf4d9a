//! The control plane (random class limits, budgets, invalid snapshots, drains and a close),
//! and one scenario run.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    Limits, LlmBulkhead, TokenBudget, classes::AdmissionClasses, classes::ClassLimits,
    limits::ApplyOutcome, limits::LimitsError,
};
use futures::future::join_all;

use super::books::{Ledger, Own, Plane, Setup, Shared, Tally, bump};
use super::callers::worker;
use super::config::{Caps, Revisions, invalid_snapshot, normalized_table, random_classes, table};
use super::heard::Heard;
use super::{BUDGET, IDS, PEAK_QUEUE, PEAK_SLOTS, QUEUE, RESERVE, SLOTS, SOLO};
use crate::chaos::mix;
use crate::chaos::runtime::{Guard, Rt, Task, yield_now};

/// A random budget, at least `floors` (the classes' token floors): 0 when they allow it,
/// below the tokens in flight, below the initial budget, or up to three times it.
fn random_budget(bulkhead: &LlmBulkhead, rng: &mut fastrand::Rng, floors: u64) -> u64 {
    let budget = match rng.u8(0..12) {
        0 => 0,
        1 => rng.u64(0..=bulkhead.stats().token_budget.unwrap().in_flight_tokens),
        2 | 3 => rng.u64(300..BUDGET),
        _ => rng.u64(BUDGET..=3 * BUDGET),
    };
    budget.max(floors)
}

fn class_ids(shared: &Shared) -> Vec<&'static str> {
    shared.handles.iter().map(|c| c.id()).collect()
}

/// New limits: global ones and class limits drawn together, valid by construction (or the
/// class limits in force kept, when they still fit). Recorded before they are applied.
fn apply_random(shared: &Shared, rng: &mut fastrand::Rng, before: &Limits) {
    let ids = class_ids(shared);
    let max_concurrent = match shared.setup.plane {
        Plane::Varying if rng.u8(0..8) == 0 => 0, // the kill switch (then no slot floors)
        Plane::Varying => rng.u32(1..=PEAK_SLOTS),
        _ => SLOTS,
    };
    let max_queue = if rng.u8(0..8) == 0 {
        0
    } else {
        rng.u32(1..=PEAK_QUEUE)
    };
    let budget = random_budget(&shared.bulkhead, rng, 0);
    let reserve = match rng.u8(0..12) {
        // Above the budget: normal-priority calls get no tokens at all.
        0 => budget + rng.u64(0..100),
        _ => rng.u64(0..=budget / 4),
    };
    let current = Caps::of(before);
    let keep = rng.u8(0..4) == 0
        && current.floors() <= u64::from(max_concurrent)
        && current.token_floors() <= budget;
    let classes: Vec<ClassLimits> = if keep {
        current.classes
    } else {
        random_classes(rng, ids.len(), max_concurrent, budget)
    };
    let next = Limits::new(before.revision + 1, max_concurrent)
        .with_max_queue(max_queue)
        .with_token_budget(budget, reserve)
        .with_admission_classes(table(rng, &ids, &classes));
    let mut expected = next.clone();
    expected.admission_classes = Some(normalized_table(&ids, &classes));
    shared
        .peak_queue
        .fetch_max(u64::from(max_queue), Ordering::AcqRel);
    shared.revisions.record(next.revision, Caps::of(&expected));
    let outcome = shared.bulkhead.apply_limits(next).unwrap();
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            previous: before.clone(),
            current: expected.clone()
        }
    );
    assert_eq!(shared.bulkhead.limits(), expected);
    bump(&shared.tally.limit_changes);
}

/// One random change (or non-change) of the limits, checked.
fn reconfigure(shared: &Shared, rng: &mut fastrand::Rng) {
    let bulkhead = &shared.bulkhead;
    let before = bulkhead.limits();
    let caps = Caps::of(&before);
    let changes = shared.setup.plane != Plane::Fixed;
    match rng.u8(0..12) {
        0..=3 if changes => apply_random(shared, rng, &before),
        4 | 5 if changes => {
            let budget = random_budget(bulkhead, rng, caps.token_floors());
            let mut expected = before.clone().with_token_budget(budget, caps.reserve);
            expected.revision += 1;
            shared
                .revisions
                .record(expected.revision, Caps::of(&expected));
            assert_eq!(bulkhead.set_budget(budget).unwrap(), expected);
            assert_eq!(bulkhead.limits(), expected);
            bump(&shared.tally.limit_changes);
        }
        6 => {
            // Stale: nothing changes, the rest is not even examined.
            let stale = Limits::new(rng.u64(0..=before.revision), rng.u32(0..=PEAK_SLOTS));
            assert_eq!(
                bulkhead.apply_limits(stale).unwrap(),
                ApplyOutcome::Stale {
                    current: before.clone()
                }
            );
            assert_eq!(bulkhead.limits(), before);
        }
        7 | 8 => {
            // Invalid: refused whole with its error, nothing changes.
            let (invalid, expected) = invalid_snapshot(rng, &before, &class_ids(shared));
            assert_eq!(
                bulkhead.apply_limits(invalid.clone()).unwrap_err(),
                expected,
                "{invalid:?}"
            );
            assert_eq!(bulkhead.limits(), before);
            bump(&shared.tally.refused_snapshots);
        }
        9 if caps.token_floors() > 0 => {
            // A budget below the token floors.
            let budget = rng.u64(0..caps.token_floors());
            assert_eq!(
                bulkhead.set_budget(budget).unwrap_err(),
                LimitsError::ProtectedTokensSumTooLarge {
                    sum: caps.token_floors(),
                    budget
                }
            );
            assert_eq!(bulkhead.limits(), before);
            bump(&shared.tally.refused_snapshots);
        }
        _ => {
            let stats = bulkhead.stats();
            assert_eq!(stats.limits, before);
            assert!(
                stats.pending <= shared.peak_queue.load(Ordering::Acquire),
                "{stats:?}"
            );
            let max = shared
                .revisions
                .max_since(0, |caps| Some(u64::from(caps.max_concurrent)));
            assert!(stats.in_flight <= max.unwrap(), "{stats:?}");
            let classes = stats.admission_classes.unwrap();
            for (c, s) in classes.classes.iter().enumerate() {
                assert_eq!(s.limits, caps.classes[c]);
                if let Some(max) = shared.revisions.max_since(0, |caps| caps.ceiling(c)) {
                    assert!(
                        s.in_flight <= max,
                        "class {c} above every ceiling {max}: {s:?}"
                    );
                }
            }
            assert_eq!(classes.shared.max_concurrent, caps.shared_slots());
            if shared.setup.plane == Plane::Fixed && caps.floors() > 0 {
                assert!(
                    classes.shared.in_flight <= classes.shared.max_concurrent,
                    "the shared pool overdrawn: {:?}",
                    classes.shared
                );
            }
        }
    }
}

fn start_drain(shared: &Arc<Shared>, drains: &mut Vec<Task>) {
    bump(&shared.tally.drains_started);
    let inner = Arc::clone(shared);
    drains.push(shared.spawn(async move {
        inner.bulkhead.drain().await;
        bump(&inner.tally.drains_resolved);
    }));
}

async fn control_plane(shared: Arc<Shared>) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.setup.seed, 0));
    let bulkhead = &shared.bulkhead;
    let total = shared.setup.workers * shared.setup.ops;
    let close_at = rng.u64(total / 2..=total * 19 / 20);
    let mut drains = Vec::new();
    while shared.ops_done.load(Ordering::Acquire) < close_at && !shared.failed() {
        reconfigure(&shared, &mut rng);
        match rng.u8(0..40) {
            0 => start_drain(&shared, &mut drains),
            1 => {
                // Cancels nothing, whatever it finds.
                let wait = Duration::from_micros(rng.u64(0..500));
                let report = bulkhead.drain_timeout(wait).await;
                if report.drained {
                    assert_eq!((report.in_flight, report.pending), (0, 0));
                }
            }
            _ => {}
        }
        shared.rt.pause(&mut rng).await;
        yield_now().await;
    }

    assert!(bulkhead.close(), "the control plane closes");
    shared.closed.store(true, Ordering::Release);
    assert!(!bulkhead.close(), "close is idempotent");
    start_drain(&shared, &mut drains);
    // After the close: nothing waits, and slots in flight (globally and in every class) only
    // go down, whatever the limits.
    let mut in_flight = u64::MAX;
    let mut class_in_flight = vec![u64::MAX; shared.handles.len()];
    while shared.workers_done.load(Ordering::Acquire) < shared.setup.workers && !shared.failed() {
        let stats = bulkhead.stats();
        assert!(stats.closed);
        assert_eq!(stats.pending, 0, "nobody waits after the close");
        assert!(
            stats.in_flight <= in_flight,
            "{in_flight} -> {}",
            stats.in_flight
        );
        in_flight = stats.in_flight;
        for (c, s) in stats.admission_classes.unwrap().classes.iter().enumerate() {
            assert!(
                s.in_flight <= class_in_flight[c],
                "class {c}: {} -> {}",
                class_in_flight[c],
                s.in_flight
            );
            class_in_flight[c] = s.in_flight;
        }
        reconfigure(&shared, &mut rng);
        shared.rt.pause(&mut rng).await;
        yield_now().await;
    }
    if !shared.failed() {
        bulkhead.drain().await;
    }
    join_all(drains).await;
}

/// Builds the scenario's bulkhead: 2 to 4 classes (`solo` last), random floors and ceilings.
fn build(rng: &mut fastrand::Rng) -> (LlmBulkhead, Vec<&'static str>, usize) {
    let n = rng.usize(2..=4);
    let mut ids: Vec<&'static str> = IDS[..n - 1].to_vec();
    ids.push(SOLO);
    let default = rng.usize(0..n - 1);
    // Some class admits something (the limits may stay fixed for the whole run).
    let classes = loop {
        let classes = random_classes(rng, n, SLOTS, BUDGET);
        if classes.iter().any(|c| c.max_concurrent != Some(0)) {
            break classes;
        }
    };
    let config = ids.iter().zip(&classes).fold(
        AdmissionClasses::new(ids[default]),
        |config, (id, limits)| config.class(*id, *limits),
    );
    let bulkhead = LlmBulkhead::builder("gpt-4o", SLOTS as usize)
        .max_queue(QUEUE as usize)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .admission_classes(config)
        .build()
        .unwrap();
    let limits = bulkhead.limits();
    assert_eq!(limits.revision, 0);
    assert_eq!(
        limits.admission_classes,
        Some(normalized_table(&ids, &classes))
    );
    (bulkhead, ids, default)
}

pub(crate) async fn scenario(name: &str, setup: Setup, rt: Rt) {
    let mut rng = fastrand::Rng::with_seed(mix(setup.seed, u64::MAX));
    let (bulkhead, ids, default) = build(&mut rng);
    let _guard = Guard::new(
        format!("classes {name}: seed {} {setup:?}", setup.seed),
        bulkhead.clone(),
    );
    let handles: Vec<_> = ids.iter().map(|id| bulkhead.class(id).unwrap()).collect();
    assert_eq!(bulkhead.classes(), &handles[..]);
    assert_eq!(bulkhead.default_class(), Some(handles[default]));
    // A handle names an id at a position: another bulkhead with our first id at its second
    // position has a class this bulkhead does not.
    let other = LlmBulkhead::builder("m", 1)
        .admission_classes(
            AdmissionClasses::new(ids[0])
                .class("elsewhere", ClassLimits::new())
                .class(ids[0], ClassLimits::new()),
        )
        .build()
        .unwrap();
    let foreign = other.class(ids[0]).unwrap();
    assert!(!handles.contains(&foreign));
    let revisions = Revisions::default();
    revisions.record(0, Caps::of(&bulkhead.limits()));
    let heard = Arc::new(Heard::default());
    let _subscription = setup.listen.then(|| {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    });
    let shared = Arc::new(Shared {
        setup,
        bulkhead: bulkhead.clone(),
        rt,
        solo: handles.len() - 1,
        handles,
        default,
        foreign,
        revisions,
        classes: ids.iter().map(|_| Default::default()).collect(),
        tally: Tally::default(),
        ledger: Ledger::default(),
        solo_book: Mutex::new(Own::default()),
        heard,
        closed: AtomicBool::new(false),
        peak_queue: AtomicU64::new(u64::from(QUEUE)),
        ops_done: AtomicU64::new(0),
        workers_done: AtomicU64::new(0),
        tasks: Arc::default(),
    });
    let started = Instant::now();
    let plane = shared.spawn(control_plane(Arc::clone(&shared)));
    let workers: Vec<_> = (0..setup.workers)
        .map(|w| shared.spawn(worker(Arc::clone(&shared), w)))
        .collect();
    join_all(workers).await;
    plane.await;
    shared.rethrow();
    assert!(bulkhead.drain_timeout(Duration::ZERO).await.drained);
    bulkhead.drain().await;
    shared.verify();
    println!("classes {name}: {:?}", started.elapsed());
}
