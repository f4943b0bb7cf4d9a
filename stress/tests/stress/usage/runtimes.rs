//! The scenario on each runtime (tokio without its time driver), and on blocked threads.

use super::callers::scenario;
use super::{CALLS, Plane, WORKERS};
use crate::kit::runtimes::Executor;
use crate::kit::scene::Setup;

/// `WORKERS` async workers of `CALLS` calls each, a listener subscribed.
fn setup(plane: Plane) -> Setup<Plane> {
    Setup::new(plane, WORKERS, CALLS).listen()
}

#[test]
fn tokio_multi_thread() {
    Executor::tokio_multi_thread_without_time().run(
        [
            setup(Plane::SlotsFixed),
            setup(Plane::SlotsFixed).always_usage(),
            setup(Plane::Varying),
            Setup::new(Plane::SlotsFixed, WORKERS, CALLS),
            setup(Plane::Closes),
        ],
        scenario,
    );
}

#[test]
fn tokio_current_thread() {
    Executor::tokio_current_thread_without_time().run([setup(Plane::SlotsFixed)], scenario);
}

#[test]
fn smol_executor() {
    Executor::smol().run(
        [
            setup(Plane::SlotsFixed),
            setup(Plane::SlotsFixed).always_usage(),
        ],
        scenario,
    );
}

#[test]
fn async_std_executor() {
    Executor::async_std().run([setup(Plane::Varying)], scenario);
}

#[test]
fn futures_block_on_with_a_thread_pool() {
    Executor::thread_pool(6).run([setup(Plane::SlotsFixed).always_usage()], scenario);
}

/// Blocked threads (`acquire_blocking`, `try_acquire`) instead of tasks: 8 threads of 1,000
/// calls each, the same invariants.
#[test]
fn blocking_threads() {
    Executor::threads().run(
        [
            Setup::new(Plane::SlotsFixed, 8, 1_000)
                .always_usage()
                .listen(),
            Setup::new(Plane::Varying, 8, 1_000).listen(),
            Setup::new(Plane::SlotsFixed, 8, 1_000),
            Setup::new(Plane::Closes, 8, 1_000).always_usage().listen(),
        ],
        scenario,
    );
}
