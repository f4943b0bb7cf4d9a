//! The dedup scenarios, one test per runtime (the runtimes of `chaos::runtimes`).

use super::books::{Plane, Setup};
use super::control_plane::scenario;
use crate::chaos::runtime::Rt;

#[test]
fn tokio_multi_thread() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let rt = Rt::tokio();
    for setup in [
        Setup::new(Plane::Varying, 10, 800),
        Setup::new(Plane::Fixed, 10, 800),
    ] {
        runtime.block_on(scenario("tokio_multi_thread", setup, rt.clone()));
    }
}

#[test]
fn tokio_current_thread() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let setup = Setup::new(Plane::Varying, 8, 800);
    runtime.block_on(scenario("tokio_current_thread", setup, Rt::tokio()));
}

#[test]
fn smol_executor() {
    let setup = Setup::new(Plane::Fixed, 8, 800);
    smol::block_on(scenario("smol", setup, Rt::smol()));
}

#[test]
fn async_std_executor() {
    let setup = Setup::new(Plane::Varying, 8, 800);
    async_std::task::block_on(scenario("async_std", setup, Rt::async_std()));
}

#[test]
fn futures_thread_pool() {
    let setup = Setup::new(Plane::Varying, 8, 800);
    futures::executor::block_on(scenario("futures_thread_pool", setup, Rt::thread_pool(4)));
}

/// Plain threads: a thread per worker (its bursts polled by that thread), with blocking
/// sleeps in the callbacks.
#[test]
fn std_threads() {
    let setup = Setup::new(Plane::Varying, 6, 800);
    futures::executor::block_on(scenario("std_threads", setup, Rt::thread_per_task()));
}
