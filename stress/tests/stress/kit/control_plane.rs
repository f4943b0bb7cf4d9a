//! The control plane every family runs: random limit changes (the family's `reconfigure`) at
//! random intervals, drains, the close at a random point, then, until every worker is done,
//! the checks of a closed bulkhead (nothing waits, slots in flight only fall) with the limits
//! still changing; and the checked limit changes the families share.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_bulkhead_llm::{Limits, LlmBulkhead, Stats, limits::ApplyOutcome};
use futures::future::join_all;

use super::books::bump;
use super::mix;
use super::runtimes::{Task, yield_now, yields};
use super::scene::{Family, Scene};

/// When the control plane closes the bulkhead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Close {
    /// Never: it changes the limits until every worker did its operations.
    Never,
    /// Once the workers did a random number of operations between these two fractions (per
    /// mille) of the run's; the workers then keep calling until they see the close, and make
    /// the schedule's `post_close_ops` more (all refused).
    Between(u64, u64),
}

/// How fast the control plane changes the limits, and how long workers think between calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pace {
    /// As clients and operators do: `Rt::pause` (nothing, a few executor turns, or up to
    /// 1.5 ms asleep) and a yield. Without think time refused calls come back at once and the
    /// run is all refusals, however long it is.
    Think,
    /// As fast as it goes: the control plane yields 1 to 19 times between changes (sleeps 50
    /// to 500 µs on plain threads), workers yield at most once between calls, so that a few
    /// workers per slot keep the bulkhead contended.
    Busy,
}

/// A family's schedule: when the close comes, whether the control plane drains, and the pace.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Schedule {
    pub(crate) close: Close,
    /// Drains along the way: `drain()` in tasks of their own (every one must resolve) and
    /// `drain_timeout` (cancels nothing, whatever it finds), and one `drain()` at the close.
    pub(crate) drains: bool,
    /// Right after the close, the control plane awaits `drain()` and checks the bulkhead idle
    /// (nothing in flight, no token held, nobody waiting) while the callers keep calling.
    pub(crate) drain_at_close: bool,
    pub(crate) pace: Pace,
    /// Operations every worker performs after it saw the close (all of them refused).
    pub(crate) post_close_ops: u64,
}

impl Scene {
    /// The control plane's pause between two rounds.
    async fn plane_pause(&self, rng: &mut fastrand::Rng) {
        match self.schedule.pace {
            Pace::Think => {
                self.rt.pause(rng).await;
                yield_now().await;
            }
            Pace::Busy if self.rt.threads() => {
                self.rt.sleep(Duration::from_micros(rng.u64(50..500))).await;
            }
            Pace::Busy => yields(rng.usize(1..20)).await,
        }
    }

    /// A worker's think time between two operations.
    pub(crate) async fn think(&self, rng: &mut fastrand::Rng) {
        match self.schedule.pace {
            Pace::Think => {
                self.rt.pause(rng).await;
                yield_now().await;
            }
            Pace::Busy => yields(usize::from(rng.u8(0..3) == 0)).await,
        }
    }
}

fn start_drain<F: Family>(shared: &Arc<F>, drains: &mut Vec<Task>) {
    bump(&shared.counts.drains_started);
    let inner = Arc::clone(shared);
    drains.push(shared.spawn(async move {
        inner.bulkhead.drain().await;
        bump(&inner.counts.drains_resolved);
    }));
}

/// Nothing in flight (slots, abandoned admissions, tokens) and nobody waiting.
pub(crate) fn assert_idle(bulkhead: &LlmBulkhead, what: &str) {
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.map_or(0, |t| t.in_flight_tokens);
    assert_eq!(
        (
            stats.in_flight,
            stats.abandoned_in_flight,
            stats.pending,
            tokens
        ),
        (0, 0, 0, 0),
        "{what}: {stats:?}"
    );
}

/// The control plane of one scenario (see the module docs and [`Schedule`]).
pub(crate) async fn control_plane<F: Family>(shared: Arc<F>) {
    let mut rng = fastrand::Rng::with_seed(mix(shared.seed, 0));
    let bulkhead = &shared.bulkhead;
    let schedule = shared.schedule;
    let total = shared.workers * shared.ops;
    let close_at = match schedule.close {
        Close::Never => None,
        Close::Between(from, to) => Some(rng.u64(total * from / 1_000..=total * to / 1_000)),
    };
    let mut drains = Vec::new();
    while shared.ops_done.load(Ordering::Acquire) < close_at.unwrap_or(total) && !shared.failed() {
        shared.reconfigure(&mut rng);
        if schedule.drains {
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
        }
        shared.plane_pause(&mut rng).await;
    }
    if close_at.is_none() {
        join_all(drains).await;
        return;
    }

    assert!(bulkhead.close(), "the control plane closes");
    shared.closed.store(true, Ordering::Release);
    assert!(!bulkhead.close(), "close is idempotent");
    if schedule.drains {
        start_drain(&shared, &mut drains);
    }
    if schedule.drain_at_close {
        bulkhead.drain().await;
        // Nothing can be admitted any more: the bulkhead stays idle while the callers call.
        assert_idle(bulkhead, "drained after the close");
    }
    // After the close: nothing waits, and slots in flight only go down, whatever the limits.
    let mut previous: Option<Stats> = None;
    while shared.workers_done.load(Ordering::Acquire) < shared.workers && !shared.failed() {
        let stats = bulkhead.stats();
        assert!(stats.closed);
        assert_eq!(stats.pending, 0, "nobody waits after the close");
        if let Some(previous) = &previous {
            assert!(
                stats.in_flight <= previous.in_flight,
                "{} -> {}",
                previous.in_flight,
                stats.in_flight
            );
        }
        if schedule.drain_at_close {
            assert_idle(bulkhead, "closed and drained");
        }
        shared.closed_round(&stats, previous.as_ref());
        shared.reconfigure(&mut rng);
        previous = Some(stats);
        shared.plane_pause(&mut rng).await;
    }
    if !shared.failed() {
        bulkhead.drain().await;
        shared.drained();
    }
    join_all(drains).await;
}

/// A random budget: 0, below the tokens in flight, below `initial`, or up to three times it
/// (the common case, so that calls are admitted between the squeezes).
pub(crate) fn random_budget(bulkhead: &LlmBulkhead, rng: &mut fastrand::Rng, initial: u64) -> u64 {
    match rng.u8(0..12) {
        0 => 0,
        1 => rng.u64(0..=bulkhead.stats().token_budget.unwrap().in_flight_tokens),
        2 | 3 => rng.u64(300..initial),
        _ => rng.u64(initial..=3 * initial),
    }
}

/// Applies `next` (one revision after `before`), which the bulkhead must report as `expected`
/// from then on; the largest queue is raised first.
pub(crate) fn apply(scene: &Scene, before: &Limits, next: Limits, expected: &Limits) {
    scene
        .peak_queue
        .fetch_max(u64::from(next.max_queue), Ordering::AcqRel);
    let outcome = scene.bulkhead.apply_limits(next).unwrap();
    assert_eq!(
        outcome,
        ApplyOutcome::Applied {
            previous: before.clone(),
            current: expected.clone()
        }
    );
    assert_eq!(scene.bulkhead.limits(), *expected);
    bump(&scene.counts.limit_changes);
}

/// The limits `set_budget(budget)` makes of `before`: the next revision, nothing else changed.
pub(crate) fn with_budget(before: &Limits, budget: u64) -> Limits {
    let reserve = before.token_budget.expect("a budget").high_priority_reserve;
    let mut next = before.clone().with_token_budget(budget, reserve);
    next.revision += 1;
    next
}

/// `set_budget`, which must make the limits `expected` (see [`with_budget`]).
pub(crate) fn set_budget(scene: &Scene, expected: &Limits) {
    let budget = expected.token_budget.unwrap().budget;
    assert_eq!(scene.bulkhead.set_budget(budget).unwrap(), *expected);
    assert_eq!(scene.bulkhead.limits(), *expected);
    bump(&scene.counts.limit_changes);
}

/// A stale snapshot (a revision already applied): nothing changes, the rest is not even
/// examined.
pub(crate) fn stale(scene: &Scene, rng: &mut fastrand::Rng, before: &Limits, peak_slots: u32) {
    let stale = Limits::new(rng.u64(0..=before.revision), rng.u32(0..=peak_slots));
    assert_eq!(
        scene.bulkhead.apply_limits(stale).unwrap(),
        ApplyOutcome::Stale {
            current: before.clone()
        }
    );
    assert_eq!(scene.bulkhead.limits(), *before);
}
