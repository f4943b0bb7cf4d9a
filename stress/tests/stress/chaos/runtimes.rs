//! The scenarios, one per runtime.

use super::control_plane::scenario;
use super::runtime::{Plane, Rt, Setup};

#[test]
fn tokio_multi_thread() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_time()
        .build()
        .unwrap();
    let rt = Rt::tokio();
    for setup in [
        Setup::new(Plane::Fixed, 12, 2_000).always_usage().listen(),
        Setup::new(Plane::SlotsFixed, 12, 2_000),
        Setup::new(Plane::Varying, 12, 2_000).listen(),
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
        Setup::new(Plane::Varying, 10, 2_000).always_usage(),
        Setup::new(Plane::SlotsFixed, 10, 2_000).listen(),
    ] {
        runtime.block_on(scenario("tokio_current_thread", setup, rt.clone()));
    }
}

#[test]
fn smol_executor() {
    let rt = Rt::smol();
    for setup in [
        Setup::new(Plane::Fixed, 10, 2_000),
        Setup::new(Plane::Varying, 10, 2_000)
            .always_usage()
            .listen(),
    ] {
        smol::block_on(scenario("smol", setup, rt.clone()));
    }
}

#[test]
fn async_std_executor() {
    let rt = Rt::async_std();
    for setup in [
        Setup::new(Plane::SlotsFixed, 10, 2_000).always_usage(),
        Setup::new(Plane::Varying, 10, 2_000).listen(),
    ] {
        async_std::task::block_on(scenario("async_std", setup, rt.clone()));
    }
}

#[test]
fn futures_thread_pool() {
    let rt = Rt::thread_pool(4);
    let setup = Setup::new(Plane::Varying, 10, 2_000).listen();
    futures::executor::block_on(scenario("futures_thread_pool", setup, rt));
}

/// Plain threads: a thread per worker (and per handed-off permit, drain and control plane),
/// with `acquire_blocking(_owned)` among the operations and blocking sleeps.
#[test]
fn std_threads() {
    let rt = Rt::thread_per_task();
    for setup in [
        Setup::new(Plane::Fixed, 8, 2_000).always_usage(),
        Setup::new(Plane::Varying, 8, 2_000).listen(),
        Setup::new(Plane::SlotsFixed, 8, 2_000)
            .always_usage()
            .listen(),
    ] {
        futures::executor::block_on(scenario("std_threads", setup, rt.clone()));
    }
}
