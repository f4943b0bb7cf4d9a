//! What a scenario is made of: its setup, the scene its tasks share, the [`Family`] trait a
//! family implements, and [`play`], which runs one scenario.

use std::fmt::Debug;
use std::future::Future;
use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{LlmBulkhead, Stats};
use futures::future::join_all;

use super::books::load;
use super::callers::worker;
use super::control_plane::{Schedule, control_plane};
use super::runtimes::{Guard, Rt, Task, Tasks};
use super::{fresh_seed, scale};

/// What a scenario varies: `P` is the family's choice of what its control plane changes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Setup<P> {
    pub(crate) seed: u64,
    pub(crate) plane: P,
    /// Every admission settles with usage (an early report, or explicit usage), so nothing is
    /// returned unreported and `reserved + overrun + reheld == consumed + refunded` holds.
    pub(crate) always_usage: bool,
    /// A listener subscribed to every event (it also changes the paths: admissions are timed).
    pub(crate) listen: bool,
    pub(crate) workers: u64,
    /// Operations per worker (scaled by `STRESS_SCALE`) before the close can happen (the
    /// close comes at a random point, if the family's schedule closes).
    pub(crate) ops: u64,
}

impl<P> Setup<P> {
    /// A fresh seed (or `CHAOS_SEED`), no listener, settlements with or without usage.
    pub(crate) fn new(plane: P, workers: u64, ops: u64) -> Setup<P> {
        Setup {
            seed: fresh_seed(),
            plane,
            always_usage: false,
            listen: false,
            workers,
            ops: ops * scale(),
        }
    }

    pub(crate) fn always_usage(mut self) -> Setup<P> {
        self.always_usage = true;
        self
    }

    pub(crate) fn listen(mut self) -> Setup<P> {
        self.listen = true;
        self
    }
}

/// Counts the kit keeps for every family.
#[derive(Default)]
pub(crate) struct Counts {
    /// Limit changes applied (each is a reconfigure event).
    pub(crate) limit_changes: AtomicU64,
    pub(crate) drains_started: AtomicU64,
    pub(crate) drains_resolved: AtomicU64,
    /// Calls refused for invalid input (decided nothing).
    pub(crate) invalid: AtomicU64,
}

/// What every task of one scenario shares, whatever the family: the bulkhead, the runtime
/// and its tasks, the run's size and schedule, the close flag and the progress counters.
pub(crate) struct Scene {
    /// `<family> <runtime>`, as reports and failures name the scenario.
    pub(crate) name: String,
    /// The name, the seed and the setup, as the watchdog and a failure report them.
    pub(crate) what: String,
    pub(crate) seed: u64,
    pub(crate) workers: u64,
    pub(crate) ops: u64,
    pub(crate) schedule: Schedule,
    pub(crate) bulkhead: LlmBulkhead,
    pub(crate) rt: Rt,
    /// The scenario's tasks (their first panic is kept and raised again at the end).
    pub(crate) tasks: Arc<Tasks>,
    /// Set (Release) once `close()` returned: a call that sees it must be refused.
    pub(crate) closed: AtomicBool,
    /// The largest `max_queue` ever applied (raised before it is applied).
    pub(crate) peak_queue: AtomicU64,
    pub(crate) ops_done: AtomicU64,
    pub(crate) workers_done: AtomicU64,
    pub(crate) counts: Counts,
}

impl Scene {
    pub(crate) fn new<P: Debug>(
        family: &str,
        runtime: &str,
        setup: &Setup<P>,
        schedule: Schedule,
        bulkhead: LlmBulkhead,
        rt: Rt,
    ) -> Scene {
        let name = format!("{family} {runtime}");
        Scene {
            what: format!("{name}: seed {} {setup:?}", setup.seed),
            name,
            seed: setup.seed,
            workers: setup.workers,
            ops: setup.ops,
            schedule,
            peak_queue: AtomicU64::new(u64::from(bulkhead.limits().max_queue)),
            bulkhead,
            rt,
            tasks: Arc::default(),
            closed: AtomicBool::new(false),
            ops_done: AtomicU64::new(0),
            workers_done: AtomicU64::new(0),
            counts: Counts::default(),
        }
    }

    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> Task {
        self.tasks.spawn(&self.rt, task)
    }

    pub(crate) fn failed(&self) -> bool {
        self.tasks.failed()
    }

    pub(crate) fn rethrow(&self) {
        self.tasks.rethrow();
    }

    /// Whether `close()` returned (read before a call starts: if set, it must be refused).
    pub(crate) fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Nobody waits beyond the largest queue ever applied.
    pub(crate) fn check_pending(&self, stats: &Stats) {
        assert!(
            stats.pending <= self.peak_queue.load(Ordering::Acquire),
            "{stats:?}"
        );
    }
}

/// A family: what its workers do, what its control plane changes, and what it checks. Its
/// shared state dereferences to the [`Scene`] the kit runs it on.
pub(crate) trait Family: Deref<Target = Scene> + Send + Sync + Sized + 'static {
    /// One random operation of worker `worker`; tasks it spawns (owned permits handed over)
    /// go to `handoffs`, which the kit joins.
    fn op<'a>(
        shared: &'a Arc<Self>,
        rng: &'a mut fastrand::Rng,
        worker: u64,
        handoffs: &'a mut Vec<Task>,
    ) -> impl Future<Output = ()> + Send + 'a;

    /// One random change (or non-change) of the limits, checked; before and after the close.
    fn reconfigure(&self, rng: &mut fastrand::Rng);

    /// Each round of the control plane after the close, once the kit checked that the
    /// bulkhead is closed, nobody waits and slots in flight did not grow since `previous`.
    fn closed_round(&self, _stats: &Stats, _previous: Option<&Stats>) {}

    /// Once every worker finished after the close and the bulkhead drained.
    fn drained(&self) {}

    /// The end-of-run invariants, once every task finished and the bulkhead drained.
    fn verify(&self);
}

/// Runs one scenario: the workers and the control plane on the scene's runtime under the
/// watchdog, then (every task done, its first panic raised again) the bulkhead must be idle,
/// `drain()` resolve, every drain started along the way have resolved, and the family's
/// end-of-run invariants hold.
pub(crate) async fn play<F: Family>(shared: Arc<F>) {
    let _guard = Guard::new(shared.what.clone(), shared.bulkhead.clone());
    let started = Instant::now();
    // The workers first: they start on the bulkhead as built, before the control plane's first
    // change (which may be the kill switch, `max_concurrent` 0: a short run whose control plane
    // is then held up would admit nothing at all).
    let workers: Vec<_> = (0..shared.workers)
        .map(|w| shared.spawn(worker(Arc::clone(&shared), w)))
        .collect();
    let plane = shared.spawn(control_plane(Arc::clone(&shared)));
    join_all(workers).await;
    plane.await;
    shared.rethrow();
    let bulkhead = &shared.bulkhead;
    assert!(bulkhead.drain_timeout(Duration::ZERO).await.drained);
    bulkhead.drain().await;
    shared.verify();
    let counts = &shared.counts;
    assert_eq!(
        load(&counts.drains_started),
        load(&counts.drains_resolved),
        "every drain resolved"
    );
    println!("{}: {:?}", shared.name, started.elapsed());
}
