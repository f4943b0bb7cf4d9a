//! What the dedup control plane changes (random limits, never `max_concurrent` 0), and one
//! scenario run on the kit.

use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{Limits, LlmBulkhead, TokenBudget, dedup::Deduplication};

use super::books::{Plane, Shared};
use super::callers::op;
use super::heard::Heard;
use super::requests::Table;
use super::{BUDGET, PEAK_QUEUE, PEAK_SLOTS, POST_CLOSE_OPS, QUEUE, SLOTS};
use crate::kit::control_plane::{Close, Pace, Schedule, apply, set_budget, with_budget};
use crate::kit::runtimes::{Rt, Task};
use crate::kit::scene::{Family, Scene, Setup, play};

/// Tags the scenarios running at once (the thread-local actor names its scenario).
static SCENARIOS: AtomicU64 = AtomicU64::new(0);

/// The close between 70% and 95% of the operations, no drains along the way.
const SCHEDULE: Schedule = Schedule {
    close: Close::Between(700, 950),
    drains: false,
    drain_at_close: false,
    pace: Pace::Think,
    post_close_ops: POST_CLOSE_OPS,
};

/// One random change of the limits (never `max_concurrent` 0: calls must get in), checked.
fn reconfigure(shared: &Shared, rng: &mut fastrand::Rng) {
    let before = shared.bulkhead.limits();
    match rng.u8(0..3) {
        0 => {
            let next = Limits::new(before.revision + 1, rng.u32(1..=PEAK_SLOTS))
                .with_max_queue(rng.u32(0..=PEAK_QUEUE))
                .with_token_budget(rng.u64(BUDGET / 2..=2 * BUDGET), 0);
            apply(shared, &before, next.clone(), &next);
        }
        1 => {
            let budget = rng.u64(BUDGET / 2..=2 * BUDGET);
            set_budget(shared, &with_budget(&before, budget));
        }
        _ => {}
    }
}

impl Family for Shared {
    fn op<'a>(
        shared: &'a Arc<Self>,
        rng: &'a mut fastrand::Rng,
        _worker: u64,
        _handoffs: &'a mut Vec<Task>,
    ) -> impl Future<Output = ()> + Send + 'a {
        op(shared, rng)
    }

    fn reconfigure(&self, rng: &mut fastrand::Rng) {
        if self.setup.plane == Plane::Varying {
            reconfigure(self, rng);
        }
    }

    fn verify(&self) {
        self.check_end();
    }
}

pub(crate) async fn scenario(runtime: &'static str, setup: Setup<Plane>, rt: Rt) {
    let bulkhead = LlmBulkhead::builder("gpt-4o", SLOTS as usize)
        .max_queue(QUEUE as usize)
        .token_budget(TokenBudget::new(BUDGET))
        .deduplication(Deduplication::new())
        .build()
        .unwrap();
    let scenario = SCENARIOS.fetch_add(1, Ordering::Relaxed);
    let heard = Arc::new(Heard::new(scenario));
    let _subscription = {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    };
    let table = Table::new();
    let shared = Arc::new(Shared {
        setup,
        scene: Scene::new("dedup", runtime, &setup, SCHEDULE, bulkhead, rt),
        scenario,
        keys: (0..table.keys()).map(|_| Mutex::new(u32::MAX)).collect(),
        table,
        next_caller: AtomicU32::new(0),
        next_flight: AtomicU32::new(0),
        callers: Mutex::new(Vec::new()),
        runs: Mutex::new(Vec::new()),
        heard,
    });
    play(shared).await;
}
