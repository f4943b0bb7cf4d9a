//! The runtimes every family runs on, how a scenario's tasks are spawned on each (their first
//! panic kept), timers and yields that work on any of them, and the watchdog.

use std::any::Any;
use std::future::{Future, poll_fn};
use std::panic::{AssertUnwindSafe, resume_unwind};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::RecvTimeoutError;
use std::sync::{Arc, Mutex, PoisonError, mpsc};
use std::task::Poll;
use std::time::Duration;

use async_bulkhead_llm::LlmBulkhead;
use futures::FutureExt;

use super::scale;

pub(crate) type Task = Pin<Box<dyn Future<Output = ()> + Send>>;
type Spawn = Arc<dyn Fn(Task) -> Task + Send + Sync>;

/// Which timer the runtime offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timer {
    Tokio,
    /// `async-io` (smol's timer; works on any executor).
    AsyncIo,
    AsyncStd,
    /// Plain threads: a blocking sleep, and `acquire_blocking` is allowed.
    Thread,
}

/// A runtime as a scenario's tasks see it: how to spawn on it, and its timer.
#[derive(Clone)]
pub(crate) struct Rt {
    pub(crate) timer: Timer,
    pub(crate) spawn: Spawn,
}

impl Rt {
    pub(crate) fn new(timer: Timer, spawn: impl Fn(Task) -> Task + Send + Sync + 'static) -> Rt {
        Rt {
            timer,
            spawn: Arc::new(spawn),
        }
    }

    /// Sleeps on the runtime's timer (with plain threads: blocks the thread).
    pub(crate) fn sleep(&self, duration: Duration) -> Task {
        match self.timer {
            Timer::Tokio => Box::pin(tokio::time::sleep(duration)),
            Timer::AsyncIo => Box::pin(async move {
                smol::Timer::after(duration).await;
            }),
            Timer::AsyncStd => Box::pin(async_std::task::sleep(duration)),
            Timer::Thread => Box::pin(async move { std::thread::sleep(duration) }),
        }
    }

    /// A timer that never blocks the thread (with plain threads [`sleep`](Rt::sleep) blocks):
    /// for a task that polls several futures at once.
    pub(crate) fn timer(&self, delay: Duration) -> Task {
        if self.threads() {
            Box::pin(async move {
                smol::Timer::after(delay).await;
            })
        } else {
            self.sleep(delay)
        }
    }

    pub(crate) fn threads(&self) -> bool {
        self.timer == Timer::Thread
    }

    /// The current tokio runtime (spawned on from inside it) and tokio's timer.
    pub(crate) fn tokio() -> Rt {
        Rt::new(Timer::Tokio, tokio_spawn)
    }

    /// The current tokio runtime, built without its time driver: `async-io`'s timer.
    pub(crate) fn tokio_without_time() -> Rt {
        Rt::new(Timer::AsyncIo, tokio_spawn)
    }

    /// A thread per task, with blocking sleeps (`acquire_blocking` allowed).
    pub(crate) fn thread_per_task() -> Rt {
        Rt::new(Timer::Thread, thread_spawn)
    }

    /// smol's global executor and `async-io`'s timer.
    pub(crate) fn smol() -> Rt {
        Rt::new(Timer::AsyncIo, |task| Box::pin(smol::spawn(task)))
    }

    /// async-std's executor and timer.
    pub(crate) fn async_std() -> Rt {
        Rt::new(Timer::AsyncStd, |task| {
            Box::pin(async_std::task::spawn(task))
        })
    }

    /// A futures thread pool of `size` threads, with `async-io`'s timer.
    pub(crate) fn thread_pool(size: usize) -> Rt {
        let pool = futures::executor::ThreadPool::builder()
            .pool_size(size)
            .create()
            .unwrap();
        Rt::new(Timer::AsyncIo, move |task| {
            let (remote, handle) = task.remote_handle();
            pool.spawn_ok(remote);
            Box::pin(handle)
        })
    }

    /// A short random pause: nothing, a few executor turns, or a short sleep.
    pub(crate) async fn pause(&self, rng: &mut fastrand::Rng) {
        match rng.u8(0..8) {
            0 | 1 => {}
            2..=4 => yields(rng.usize(1..4)).await,
            5 | 6 => self.sleep(Duration::from_micros(rng.u64(0..300))).await,
            _ => self.sleep(Duration::from_micros(rng.u64(300..1_500))).await,
        }
    }
}

/// The executor a test runs its scenarios on (built once per test), and the [`Rt`] its
/// scenarios' tasks use.
pub(crate) struct Executor {
    /// Its name in the scenarios' reports and watchdog messages.
    pub(crate) name: &'static str,
    rt: Rt,
    on: On,
}

enum On {
    Tokio(tokio::runtime::Runtime),
    Smol,
    AsyncStd,
    /// `futures::executor::block_on` (the thread pool, and a thread per task).
    Futures,
}

impl Executor {
    fn tokio(name: &'static str, mut builder: tokio::runtime::Builder, time: bool) -> Executor {
        if time {
            builder.enable_time();
        }
        let rt = if time {
            Rt::tokio()
        } else {
            Rt::tokio_without_time()
        };
        Executor {
            name,
            rt,
            on: On::Tokio(builder.build().unwrap()),
        }
    }

    fn multi_thread() -> tokio::runtime::Builder {
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder.worker_threads(4);
        builder
    }

    /// tokio's multi-thread runtime (4 workers) with its time driver: queue timeouts wait on
    /// tokio's clock (with the crate's `tokio` feature), the tasks sleep on it.
    pub(crate) fn tokio_multi_thread() -> Executor {
        Executor::tokio("tokio_multi_thread", Executor::multi_thread(), true)
    }

    /// tokio's current-thread runtime with its time driver.
    pub(crate) fn tokio_current_thread() -> Executor {
        let builder = tokio::runtime::Builder::new_current_thread();
        Executor::tokio("tokio_current_thread", builder, true)
    }

    /// tokio's multi-thread runtime (4 workers) without its time driver: queue timeouts wait
    /// on the crate's own timer, even with its `tokio` feature.
    pub(crate) fn tokio_multi_thread_without_time() -> Executor {
        Executor::tokio("tokio_multi_thread", Executor::multi_thread(), false)
    }

    /// tokio's current-thread runtime without its time driver.
    pub(crate) fn tokio_current_thread_without_time() -> Executor {
        let builder = tokio::runtime::Builder::new_current_thread();
        Executor::tokio("tokio_current_thread", builder, false)
    }

    pub(crate) fn smol() -> Executor {
        Executor {
            name: "smol",
            rt: Rt::smol(),
            on: On::Smol,
        }
    }

    pub(crate) fn async_std() -> Executor {
        Executor {
            name: "async_std",
            rt: Rt::async_std(),
            on: On::AsyncStd,
        }
    }

    /// A futures thread pool of `size` threads, the scenario itself on `block_on`.
    pub(crate) fn thread_pool(size: usize) -> Executor {
        Executor {
            name: "futures_thread_pool",
            rt: Rt::thread_pool(size),
            on: On::Futures,
        }
    }

    /// Plain threads: a thread per task, with blocking sleeps (`acquire_blocking` allowed).
    pub(crate) fn threads() -> Executor {
        Executor {
            name: "std_threads",
            rt: Rt::thread_per_task(),
            on: On::Futures,
        }
    }

    pub(crate) fn block_on<F: Future>(&self, future: F) -> F::Output {
        match &self.on {
            On::Tokio(runtime) => runtime.block_on(future),
            On::Smol => smol::block_on(future),
            On::AsyncStd => async_std::task::block_on(future),
            On::Futures => futures::executor::block_on(future),
        }
    }

    /// Runs `scenario` on this executor for each setup, one after the other.
    pub(crate) fn run<S, F: Future<Output = ()>>(
        &self,
        setups: impl IntoIterator<Item = S>,
        scenario: impl Fn(&'static str, S, Rt) -> F,
    ) {
        for setup in setups {
            self.block_on(scenario(self.name, setup, self.rt.clone()));
        }
    }
}

/// The tasks of one scenario: they run on its runtime, and the first panic of any of them is
/// kept (and the others told to stop) until every task ended, then raised again.
#[derive(Default)]
pub(crate) struct Tasks {
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    failed: AtomicBool,
}

impl Tasks {
    /// Spawns `task` on `rt`, keeping its panic.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        rt: &Rt,
        task: impl Future<Output = ()> + Send + 'static,
    ) -> Task {
        let tasks = Arc::clone(self);
        (rt.spawn)(Box::pin(async move {
            if let Err(panic) = AssertUnwindSafe(task).catch_unwind().await {
                tasks.failed.store(true, Ordering::Release);
                let mut kept = tasks.panic.lock().unwrap_or_else(PoisonError::into_inner);
                kept.get_or_insert(panic);
            }
        }))
    }

    /// Whether a task panicked (the others stop at their next check).
    pub(crate) fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    /// Raises the first panic again, if any.
    pub(crate) fn rethrow(&self) {
        let kept = self
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(panic) = kept {
            resume_unwind(panic);
        }
    }
}

pub(crate) fn tokio_spawn(task: Task) -> Task {
    let handle = tokio::spawn(task);
    Box::pin(async move { handle.await.unwrap() })
}

/// A thread per task; the returned future blocks while it joins it (threads mode only).
fn thread_spawn(task: Task) -> Task {
    let handle = std::thread::spawn(move || futures::executor::block_on(task));
    Box::pin(async move { handle.join().unwrap() })
}

/// Yields to the executor once, whatever the runtime.
pub(crate) async fn yield_now() {
    let mut yielded = false;
    poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await
}

pub(crate) async fn yields(n: usize) {
    for _ in 0..n {
        yield_now().await;
    }
}

/// A future that remembers whether it was ever polled: an acquire decides (and is counted) at
/// its first poll, and not at all if it is dropped before.
pub(crate) struct Tracked<F> {
    inner: F,
    pub(crate) polled: bool,
}

impl<F: Future + Unpin> Tracked<F> {
    pub(crate) fn new(inner: F) -> Tracked<F> {
        Tracked {
            inner,
            polled: false,
        }
    }
}

impl<F: Future + Unpin> Future for Tracked<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        self.polled = true;
        Pin::new(&mut self.inner).poll(cx)
    }
}

/// Polls `future` exactly once.
pub(crate) async fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    poll_fn(|cx| Poll::Ready(Pin::new(&mut *future).poll(cx))).await
}

/// Prints the seed if the scenario fails, and aborts the process if it hangs.
pub(crate) struct Guard {
    what: String,
    stop: Option<mpsc::Sender<()>>,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl Guard {
    pub(crate) fn new(what: String, bulkhead: LlmBulkhead) -> Guard {
        // Generous: a healthy scenario takes a few seconds even at a large scale.
        let limit = Duration::from_secs(120 + 60 * scale());
        let (stop, stopped) = mpsc::channel::<()>();
        let name = what.clone();
        let watchdog = std::thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(limit) {
                eprintln!(
                    "stress: {name} still running after {limit:?}: hung; {:?}",
                    bulkhead.stats()
                );
                std::process::abort();
            }
        });
        Guard {
            what,
            stop: Some(stop),
            watchdog: Some(watchdog),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(watchdog) = self.watchdog.take() {
            let _ = watchdog.join();
        }
        if std::thread::panicking() {
            eprintln!("stress: FAILED {} (replay with CHAOS_SEED)", self.what);
        }
    }
}
