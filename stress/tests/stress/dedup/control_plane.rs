//! The control plane (random limits, then a close) and one scenario run.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    Limits, LlmBulkhead, TokenBudget, dedup::Deduplication, limits::ApplyOutcome,
};
use futures::future::join_all;

use super::books::{Plane, Setup, Shared};
use super::callers::worker;
use super::heard::Heard;
use super::requests::Table;
use super::{BUDGET, PEAK_QUEUE, PEAK_SLOTS, QUEUE, SLOTS};
use crate::chaos::mix;
use crate::chaos::runtime::{Guard, Rt, yield_now};

/// Tags the scenarios running at once (the thread-local actor names its scenario).
static SCENARIOS: AtomicU64 = AtomicU64::new(0);

/// One random change of the limits (never `max_concurrent` 0: calls must get in), checked.
fn reconfigure(shared: &Shared, rng: &mut fastrand::Rng) {
    let bulkhead = &shared.bulkhead;
    let before = bulkhead.limits();
    match rng.u8(0..3) {
        0 => {
            let next = Limits::new(before.revision + 1, rng.u32(1..=PEAK_SLOTS))
                .with_max_queue(rng.u32(0..=PEAK_QUEUE))
                .with_token_budget(rng.u64(BUDGET / 2..=2 * BUDGET), 0);
            let outcome = bulkhead.apply_limits(next.clone()).unwrap();
            assert_eq!(
                outcome,
                ApplyOutcome::Applied {
                    previous: before,
                    current: next
                }
            );
        }
        1 => {
            let budget = rng.u64(BUDGET / 2..=2 * BUDGET);
            let current = bulkhead.set_budget(budget).unwrap();
            assert_eq!(current.revision, before.revision + 1);
            assert_eq!(current.token_budget.unwrap().budget, budget);
        }
        _ => return,
    }
    shared.limit_changes.fetch_add(1, Ordering::Relaxed);
}

async fn control_plane(shared: Arc<Shared>) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.setup.seed, 0));
    let bulkhead = &shared.bulkhead;
    let total = shared.setup.workers * shared.setup.ops;
    let close_at = rng.u64(total * 7 / 10..=total * 19 / 20);
    while shared.ops_done.load(Ordering::Acquire) < close_at && !shared.failed() {
        if shared.setup.plane == Plane::Varying {
            reconfigure(&shared, &mut rng);
        }
        shared.rt.pause(&mut rng).await;
        yield_now().await;
    }
    assert!(bulkhead.close(), "the control plane closes");
    shared.closed.store(true, Ordering::Release);
    // Nothing waits once the close returned (followers wait, but in no queue).
    while shared.workers_done.load(Ordering::Acquire) < shared.setup.workers && !shared.failed() {
        let stats = bulkhead.stats();
        assert!(stats.closed);
        assert_eq!(stats.pending, 0, "nobody queues after the close");
        shared.rt.pause(&mut rng).await;
        yield_now().await;
    }
}

pub(crate) async fn scenario(name: &str, setup: Setup, rt: Rt) {
    let bulkhead = LlmBulkhead::builder("gpt-4o", SLOTS as usize)
        .max_queue(QUEUE as usize)
        .token_budget(TokenBudget::new(BUDGET))
        .deduplication(Deduplication::new())
        .build()
        .unwrap();
    let _guard = Guard::new(
        format!("dedup {name}: seed {} {setup:?}", setup.seed),
        bulkhead.clone(),
    );
    let scenario = SCENARIOS.fetch_add(1, Ordering::Relaxed);
    let heard = Arc::new(Heard::new(scenario));
    let _subscription = {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    };
    let table = Table::new();
    let shared = Arc::new(Shared {
        setup,
        scenario,
        bulkhead: bulkhead.clone(),
        rt,
        keys: (0..table.keys()).map(|_| Mutex::new(u32::MAX)).collect(),
        table,
        next_caller: AtomicU32::new(0),
        next_flight: AtomicU32::new(0),
        callers: Mutex::new(Vec::new()),
        runs: Mutex::new(Vec::new()),
        heard,
        closed: AtomicBool::new(false),
        ops_done: AtomicU64::new(0),
        workers_done: AtomicU64::new(0),
        limit_changes: AtomicU64::new(0),
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
    shared.verify();
    println!("dedup {name}: {:?}", started.elapsed());
}
