//! Scenarios and runtimes: what a scenario varies, how tasks are spawned, and the watchdog.

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

use super::{PEAK_SLOTS, SLOTS, fresh_seed, scale};

/// What the control plane changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plane {
    /// Nothing (only stale and invalid snapshots, which change nothing): fixed limits.
    Fixed,
    /// The budget, the reserve and the queue; `max_concurrent` stays at `SLOTS`.
    SlotsFixed,
    /// Everything, `max_concurrent` 0 (the kill switch) and `max_queue` 0 included.
    Varying,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Setup {
    pub(crate) seed: u64,
    pub(crate) plane: Plane,
    /// Every admission settles with usage (an early report, or explicit usage), so nothing is
    /// returned unreported and `reserved + overrun + reheld == consumed + refunded` holds.
    pub(crate) always_usage: bool,
    /// A listener subscribed to every event (it also changes the paths: admissions are timed).
    pub(crate) listen: bool,
    pub(crate) workers: u64,
    /// Operations per worker before the close can happen (the close comes at a random point).
    pub(crate) ops: u64,
}

impl Setup {
    pub(crate) fn new(plane: Plane, workers: u64, ops: u64) -> Setup {
        Setup {
            seed: fresh_seed(),
            plane,
            always_usage: false,
            listen: false,
            workers,
            ops: ops * scale(),
        }
    }

    pub(crate) fn always_usage(mut self) -> Setup {
        self.always_usage = true;
        self
    }

    pub(crate) fn listen(mut self) -> Setup {
        self.listen = true;
        self
    }

    /// The most holders there may ever be at once.
    pub(crate) fn ceiling(&self) -> u64 {
        u64::from(match self.plane {
            Plane::Fixed | Plane::SlotsFixed => SLOTS,
            Plane::Varying => PEAK_SLOTS,
        })
    }
}

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

    pub(crate) fn threads(&self) -> bool {
        self.timer == Timer::Thread
    }

    /// The current tokio runtime (spawned on from inside it) and tokio's timer.
    pub(crate) fn tokio() -> Rt {
        Rt::new(Timer::Tokio, tokio_spawn)
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
                    "chaos: {name} still running after {limit:?}: hung; {:?}",
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
            eprintln!("chaos: FAILED {} (replay with CHAOS_SEED)", self.what);
        }
    }
}
