//! The scenario on each runtime, and on blocked threads.

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_bulkhead_llm::{LlmBulkhead, LlmRequest};

use super::books::Shared;
use super::callers::{
    Setup, assert_idle_after_close, new_bulkhead, random_call, reconfigure, report_step, scenario,
    settle,
};
use super::plan::Plan;
use super::scale;
use crate::caller_model::{AnyPermit, Model};
use crate::kit::runtimes::tokio_spawn;

#[test]
fn tokio_multi_thread() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    for setup in [
        Setup::new(0),
        Setup::new(1).always_usage(),
        Setup::new(2).varying_slots(),
        Setup::new(3).unobserved(),
        Setup::new(4).closes(),
    ] {
        runtime.block_on(scenario(setup, tokio_spawn));
    }
}

#[test]
fn tokio_current_thread() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let setup = Setup::new(10);
    runtime.block_on(scenario(setup, tokio_spawn));
}

#[test]
fn smol_executor() {
    for setup in [Setup::new(20), Setup::new(21).always_usage()] {
        smol::block_on(scenario(setup, |task| Box::pin(smol::spawn(task))));
    }
}

#[test]
fn async_std_executor() {
    let setup = Setup::new(30).varying_slots();
    async_std::task::block_on(scenario(setup, |task| {
        Box::pin(async_std::task::spawn(task))
    }));
}

#[test]
fn futures_block_on_with_a_thread_pool() {
    let pool = futures::executor::ThreadPool::builder()
        .pool_size(6)
        .create()
        .unwrap();
    let setup = Setup::new(40).always_usage();
    futures::executor::block_on(scenario(setup, |task| {
        let (remote, handle) = futures::FutureExt::remote_handle(task);
        pool.spawn_ok(remote);
        Box::pin(handle)
    }));
}

// ===== blocked threads =====

/// A short pause between reports: nothing, a yield, or a spin.
fn pause(rng: &mut fastrand::Rng) {
    match rng.u8(0..4) {
        0 => std::thread::yield_now(),
        1 => {
            for _ in 0..rng.usize(0..300) {
                std::hint::spin_loop();
            }
        }
        _ => {}
    }
}

fn blocking_call(bulkhead: &LlmBulkhead, shared: &Shared, setup: Setup, seed: u64) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let (reservation, options) = random_call(&mut rng);
    let plan = Plan::new(&mut rng, reservation, setup.always_usage);
    let queued = options.timeout(Duration::from_micros(rng.u64(0..3_000)));
    let request = LlmRequest::new();
    let acquired = match rng.u8(0..6) {
        0 => bulkhead
            .try_acquire(&request, options)
            .map(AnyPermit::Borrowed),
        1 => bulkhead
            .try_acquire_owned(&request, options)
            .map(AnyPermit::Owned),
        2 | 3 => bulkhead
            .acquire_blocking(&request, queued)
            .map(AnyPermit::Borrowed),
        _ => bulkhead
            .acquire_blocking_owned(&request, queued)
            .map(AnyPermit::Owned),
    };
    let mut permit = match acquired {
        Ok(permit) => permit,
        Err(error) => return shared.tally.refused(error),
    };
    shared.tally.admitted.fetch_add(1, Ordering::Relaxed);
    shared.ledger.enter();
    assert_eq!(permit.reservation(), Some(reservation));
    let mut model = Model::new(reservation);
    for k in 0..plan.reports {
        pause(&mut rng);
        let (usage, progressive) = plan.report(&mut rng, k, reservation.max_output());
        report_step(&mut permit, &mut model, usage, progressive, &shared.tally);
    }
    pause(&mut rng);
    shared.ledger.leave();
    if rng.u8(0..8) == 0 {
        // Settled on a fresh thread: its bookings land in another statistics shard, which the
        // next thread adopts when this one exits.
        std::thread::scope(|s| {
            s.spawn(|| settle(permit, model, &plan, &shared.tally));
        });
    } else {
        settle(permit, model, &plan, &shared.tally);
    }
}

/// Blocked threads (`acquire_blocking`, `try_acquire`) instead of tasks: the same invariants.
#[test]
fn blocking_threads() {
    for setup in [
        Setup::new(50).always_usage(),
        Setup::new(51).varying_slots(),
        Setup::new(52).unobserved(),
        Setup::new(53).closes().always_usage(),
    ] {
        let bulkhead = new_bulkhead();
        let (shared, _subscription) = Shared::new(&bulkhead, setup);
        let threads = 8u64;
        let per_thread = 1_000 * scale();
        let callers = threads * per_thread;
        std::thread::scope(|s| {
            for t in 0..threads {
                let (bulkhead, shared) = (&bulkhead, &shared);
                s.spawn(move || {
                    shared.guard(|| {
                        for i in 0..per_thread {
                            let seed = setup.seed * 1_000_003 + t * per_thread + i;
                            blocking_call(bulkhead, shared, setup, seed);
                            shared.tally.done.fetch_add(1, Ordering::AcqRel);
                        }
                    });
                });
            }
            s.spawn(|| {
                let mut rng = fastrand::Rng::with_seed(setup.seed);
                shared.guard(|| {
                    while shared.plane_continues(setup, callers) {
                        reconfigure(&bulkhead, &mut rng, setup);
                        std::thread::sleep(Duration::from_micros(rng.u64(50..500)));
                    }
                    if setup.closes {
                        assert!(bulkhead.close());
                        futures::executor::block_on(bulkhead.drain());
                        assert_idle_after_close(&bulkhead);
                    }
                });
            });
        });
        shared.rethrow();
        assert!(futures::executor::block_on(bulkhead.drain_timeout(Duration::ZERO)).drained);
        shared.verify(&bulkhead, callers, setup);
    }
}
