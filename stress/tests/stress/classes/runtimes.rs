//! The class scenarios, one test per runtime (the runtimes of `chaos::runtimes`).

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
        Setup::new(Plane::Fixed, 10, 2_000).always_usage().listen(),
        Setup::new(Plane::ClassesVary, 10, 2_000).listen(),
        Setup::new(Plane::Varying, 10, 2_000),
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
    let rt = Rt::tokio();
    for setup in [
        Setup::new(Plane::ClassesVary, 8, 2_000).always_usage(),
        Setup::new(Plane::Fixed, 8, 2_000).listen(),
    ] {
        runtime.block_on(scenario("tokio_current_thread", setup, rt.clone()));
    }
}

#[test]
fn smol_executor() {
    let rt = Rt::smol();
    for setup in [
        Setup::new(Plane::Fixed, 8, 2_000),
        Setup::new(Plane::Varying, 8, 2_000).always_usage().listen(),
    ] {
        smol::block_on(scenario("smol", setup, rt.clone()));
    }
}

#[test]
fn async_std_executor() {
    let rt = Rt::async_std();
    for setup in [
        Setup::new(Plane::ClassesVary, 8, 2_000).listen(),
        Setup::new(Plane::Fixed, 8, 2_000).always_usage(),
    ] {
        async_std::task::block_on(scenario("async_std", setup, rt.clone()));
    }
}

#[test]
fn futures_thread_pool() {
    let rt = Rt::thread_pool(4);
    for setup in [
        Setup::new(Plane::Varying, 8, 2_000).listen(),
        Setup::new(Plane::Fixed, 8, 2_000),
    ] {
        futures::executor::block_on(scenario("futures_thread_pool", setup, rt.clone()));
    }
}

/// Plain threads: a thread per worker (and per handed-off permit, drain and control plane),
/// with `acquire_blocking(_owned)` among the operations and blocking sleeps.
#[test]
fn std_threads() {
    let rt = Rt::thread_per_task();
    for setup in [
        Setup::new(Plane::Fixed, 6, 2_000).always_usage().listen(),
        Setup::new(Plane::ClassesVary, 6, 2_000),
        Setup::new(Plane::Varying, 6, 2_000).listen(),
    ] {
        futures::executor::block_on(scenario("std_threads", setup, rt.clone()));
    }
}
