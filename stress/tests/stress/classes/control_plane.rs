//! What the class control plane changes (random class limits, budgets, invalid snapshots and
//! budgets below the token floors, stale snapshots), its checks of a closed bulkhead's classes,
//! and one scenario run on the kit.

use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    Limits, LlmBulkhead, Stats, TokenBudget, classes::AdmissionClasses, classes::ClassLimits,
    limits::LimitsError,
};

use super::books::{ClassBook, Own, Plane, Shared};
use super::callers::op;
use super::config::{Caps, Revisions, invalid_snapshot, normalized_table, random_classes, table};
use super::{BUDGET, IDS, PEAK_QUEUE, PEAK_SLOTS, POST_CLOSE_OPS, QUEUE, RESERVE, SLOTS, SOLO};
use crate::kit::books::{Heard, Ledger, bump};
use crate::kit::control_plane::{
    Close, Pace, Schedule, apply, random_budget, set_budget, stale, with_budget,
};
use crate::kit::mix;
use crate::kit::runtimes::{Rt, Task};
use crate::kit::scene::{Family, Scene, Setup, play};

/// The close between half and 95% of the operations, drains along the way.
const SCHEDULE: Schedule = Schedule {
    close: Close::Between(500, 950),
    drains: true,
    drain_at_close: false,
    pace: Pace::Think,
    post_close_ops: POST_CLOSE_OPS,
};

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
    let budget = random_budget(&shared.bulkhead, rng, BUDGET);
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
    shared.revisions.record(next.revision, Caps::of(&expected));
    apply(shared, before, next, &expected);
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
            // At least the token floors.
            let budget = random_budget(bulkhead, rng, BUDGET).max(caps.token_floors());
            let expected = with_budget(&before, budget);
            shared
                .revisions
                .record(expected.revision, Caps::of(&expected));
            set_budget(shared, &expected);
        }
        6 => stale(shared, rng, &before, PEAK_SLOTS),
        7 | 8 => {
            // Invalid: refused whole with its error, nothing changes.
            let (invalid, expected) = invalid_snapshot(rng, &before, &class_ids(shared));
            assert_eq!(
                bulkhead.apply_limits(invalid.clone()).unwrap_err(),
                expected,
                "{invalid:?}"
            );
            assert_eq!(bulkhead.limits(), before);
            bump(&shared.refused_snapshots);
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
            bump(&shared.refused_snapshots);
        }
        _ => {
            let stats = bulkhead.stats();
            assert_eq!(stats.limits, before);
            shared.check_pending(&stats);
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

/// After the close, slots in flight in every class only go down, whatever the limits.
fn closed_round(stats: &Stats, previous: Option<&Stats>) {
    let Some(previous) = previous else { return };
    let classes = &stats.admission_classes.as_ref().unwrap().classes;
    let before = &previous.admission_classes.as_ref().unwrap().classes;
    for (c, (s, p)) in classes.iter().zip(before).enumerate() {
        assert!(
            s.in_flight <= p.in_flight,
            "class {c}: {} -> {}",
            p.in_flight,
            s.in_flight
        );
    }
}

impl Family for Shared {
    fn op<'a>(
        shared: &'a Arc<Self>,
        rng: &'a mut fastrand::Rng,
        worker: u64,
        handoffs: &'a mut Vec<Task>,
    ) -> impl Future<Output = ()> + Send + 'a {
        op(shared, rng, worker, handoffs)
    }

    fn reconfigure(&self, rng: &mut fastrand::Rng) {
        reconfigure(self, rng);
    }

    fn closed_round(&self, stats: &Stats, previous: Option<&Stats>) {
        closed_round(stats, previous);
    }

    fn verify(&self) {
        self.check_end();
    }
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

pub(crate) async fn scenario(runtime: &'static str, setup: Setup<Plane>, rt: Rt) {
    let mut rng = fastrand::Rng::with_seed(mix(setup.seed, u64::MAX));
    let (bulkhead, ids, default) = build(&mut rng);
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
    let heard = Arc::new(Heard::new(true));
    let _subscription = setup.listen.then(|| {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    });
    let shared = Arc::new(Shared {
        setup,
        scene: Scene::new("classes", runtime, &setup, SCHEDULE, bulkhead, rt),
        solo: handles.len() - 1,
        handles,
        default,
        foreign,
        revisions,
        classes: ids.iter().map(|_| ClassBook::new(setup.listen)).collect(),
        ledger: Ledger::default(),
        solo_book: Mutex::new(Own::default()),
        heard,
        refused_snapshots: AtomicU64::new(0),
    });
    play(shared).await;
}
