//! The dedup scenarios, one test per runtime (the kit's runtimes).

use super::books::Plane;
use super::control_plane::scenario;
use crate::kit::runtimes::Executor;
use crate::kit::scene::Setup;

#[test]
fn tokio_multi_thread() {
    Executor::tokio_multi_thread().run(
        [
            Setup::new(Plane::Varying, 10, 800),
            Setup::new(Plane::Fixed, 10, 800),
        ],
        scenario,
    );
}

#[test]
fn tokio_current_thread() {
    Executor::tokio_current_thread().run([Setup::new(Plane::Varying, 8, 800)], scenario);
}

#[test]
fn smol_executor() {
    Executor::smol().run([Setup::new(Plane::Fixed, 8, 800)], scenario);
}

#[test]
fn async_std_executor() {
    Executor::async_std().run([Setup::new(Plane::Varying, 8, 800)], scenario);
}

#[test]
fn futures_thread_pool() {
    Executor::thread_pool(4).run([Setup::new(Plane::Varying, 8, 800)], scenario);
}

/// Plain threads: a thread per worker (its bursts polled by that thread), with blocking
/// sleeps in the callbacks.
#[test]
fn std_threads() {
    Executor::threads().run([Setup::new(Plane::Varying, 6, 800)], scenario);
}
