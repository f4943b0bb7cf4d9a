//! The class scenarios, one test per runtime (the kit's runtimes).

use super::books::Plane;
use super::control_plane::scenario;
use crate::kit::runtimes::Executor;
use crate::kit::scene::Setup;

#[test]
fn tokio_multi_thread() {
    Executor::tokio_multi_thread().run(
        [
            Setup::new(Plane::Fixed, 10, 2_000).always_usage().listen(),
            Setup::new(Plane::ClassesVary, 10, 2_000).listen(),
            Setup::new(Plane::Varying, 10, 2_000),
        ],
        scenario,
    );
}

#[test]
fn tokio_current_thread() {
    Executor::tokio_current_thread().run(
        [
            Setup::new(Plane::ClassesVary, 8, 2_000).always_usage(),
            Setup::new(Plane::Fixed, 8, 2_000).listen(),
        ],
        scenario,
    );
}

#[test]
fn smol_executor() {
    Executor::smol().run(
        [
            Setup::new(Plane::Fixed, 8, 2_000),
            Setup::new(Plane::Varying, 8, 2_000).always_usage().listen(),
        ],
        scenario,
    );
}

#[test]
fn async_std_executor() {
    Executor::async_std().run(
        [
            Setup::new(Plane::ClassesVary, 8, 2_000).listen(),
            Setup::new(Plane::Fixed, 8, 2_000).always_usage(),
        ],
        scenario,
    );
}

#[test]
fn futures_thread_pool() {
    Executor::thread_pool(4).run(
        [
            Setup::new(Plane::Varying, 8, 2_000).listen(),
            Setup::new(Plane::Fixed, 8, 2_000),
        ],
        scenario,
    );
}

/// Plain threads: a thread per worker (and per handed-off permit, drain and control plane),
/// with `acquire_blocking(_owned)` among the operations and blocking sleeps.
#[test]
fn std_threads() {
    Executor::threads().run(
        [
            Setup::new(Plane::Fixed, 6, 2_000).always_usage().listen(),
            Setup::new(Plane::ClassesVary, 6, 2_000),
            Setup::new(Plane::Varying, 6, 2_000).listen(),
        ],
        scenario,
    );
}
