//! Helpers shared by the general bulkhead's tests: the three runtimes, a recording reject hook,
//! a gate that holds slow calls until released, hand polling.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    Bulkhead, BulkheadError, bulkhead::BulkheadBuilder, bulkhead::BulkheadState,
};
use futures::FutureExt;
use futures::channel::oneshot;
use futures::future::Shared;

/// How long to wait for another thread or task before declaring a hang.
pub(crate) const PATIENCE: Duration = Duration::from_secs(10);

/// Runs `scenario` on a tokio multi-thread runtime (time driver on: with the `tokio` feature
/// its queue timeouts wait on tokio's running clock), spawned as a task on a worker.
pub(crate) fn on_tokio<F, Fut>(scenario: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let task = runtime.spawn(scenario());
    runtime
        .block_on(task)
        .expect("the scenario completes without panicking");
}

/// Runs `scenario` on smol's executor.
pub(crate) fn on_smol<F, Fut>(scenario: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    smol::block_on(scenario());
}

/// Runs `scenario` on async-std's executor.
pub(crate) fn on_async_std<F, Fut>(scenario: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = ()>,
{
    async_std::task::block_on(scenario());
}

/// One module per statement, one test per runtime: `$name::tokio`, `$name::smol`,
/// `$name::async_std`, each running the scenario `$scenario` (an `async fn()`).
macro_rules! on_three_runtimes {
    ($name:ident, $scenario:path) => {
        mod $name {
            #[test]
            fn tokio() {
                $crate::support::on_tokio($scenario);
            }

            #[test]
            fn smol() {
                $crate::support::on_smol($scenario);
            }

            #[test]
            fn async_std() {
                $crate::support::on_async_std($scenario);
            }
        }
    };
}
pub(crate) use on_three_runtimes;

/// A reject hook that records every refusal it hears.
#[derive(Clone, Default)]
pub(crate) struct Heard(Arc<Mutex<Vec<BulkheadError>>>);

impl Heard {
    pub(crate) fn new() -> Heard {
        Heard::default()
    }

    /// Installs the recording hook on `builder`.
    pub(crate) fn on(&self, builder: BulkheadBuilder) -> BulkheadBuilder {
        let heard = self.clone();
        builder.on_reject(move |error| heard.0.lock().unwrap().push(*error))
    }

    /// Every refusal heard so far, in order.
    pub(crate) fn all(&self) -> Vec<BulkheadError> {
        self.0.lock().unwrap().clone()
    }

    pub(crate) fn count(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// The states the hook received, in order.
    pub(crate) fn states(&self) -> Vec<BulkheadState> {
        self.all().iter().map(BulkheadError::state).collect()
    }
}

/// A gate slow calls wait on until it opens.
pub(crate) struct Gate {
    open: Option<oneshot::Sender<()>>,
    wait: Shared<oneshot::Receiver<()>>,
}

impl Gate {
    pub(crate) fn new() -> Gate {
        let (open, wait) = oneshot::channel();
        Gate {
            open: Some(open),
            wait: wait.shared(),
        }
    }

    /// A future that resolves once the gate opens.
    pub(crate) fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let wait = self.wait.clone();
        async move {
            wait.await.expect("the gate opens, never drops");
        }
    }

    pub(crate) fn open(&mut self) {
        self.open
            .take()
            .expect("opened once")
            .send(())
            .expect("someone waits");
    }
}

/// The state `{active, queued}`.
pub(crate) fn st(active: u64, queued: u64) -> BulkheadState {
    BulkheadState::new(active, queued)
}

/// Polls `future` once with the current task's waker.
pub(crate) async fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    futures::poll!(future)
}

/// Asserts that `future` is still pending.
pub(crate) async fn assert_pending<F: Future + Unpin>(future: &mut F)
where
    F::Output: std::fmt::Debug,
{
    let polled = poll_once(future).await;
    assert!(polled.is_pending(), "expected pending, got {polled:?}");
}

/// Polls `future` once and returns its output, which must be ready.
pub(crate) async fn ready<F: Future + Unpin>(future: &mut F) -> F::Output {
    match poll_once(future).await {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("expected ready, still pending"),
    }
}

/// Waits (without a runtime, on this thread) until `condition` holds, at most [`PATIENCE`].
pub(crate) fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < PATIENCE, "never happened: {what}");
        thread::yield_now();
    }
}

/// A bulkhead of `max_concurrent` slots and a queue of `max_queue` places, default timeout.
pub(crate) fn bulkhead(max_concurrent: usize, max_queue: usize) -> Bulkhead {
    Bulkhead::builder(max_concurrent)
        .max_queue(max_queue)
        .build()
        .expect("valid max_concurrent")
}

/// Asserts the identity of a quiet bulkhead: every admission released or still active.
pub(crate) fn assert_books(bulkhead: &Bulkhead) {
    let stats = bulkhead.stats();
    assert_eq!(
        stats.admitted,
        stats.released + stats.active,
        "admitted == released + active: {stats:?}"
    );
    assert_eq!(stats.queued, 0, "quiet: nobody queued: {stats:?}");
}
