//! A runtime-agnostic timer for queue timeouts and bounded drains: a process-wide *clock*
//! thread that moves registered deadlines to a due list when they pass, and *waker* threads
//! that call the due wakers.
//!
//! Futures of this crate must time out on tokio (current-thread and multi-thread), smol,
//! async-std and a plain `block_on` without a runtime feature, so they cannot rely on a
//! runtime's timer. A [`Sleep`] registers only while it is pending and deregisters when it
//! completes or is dropped, so the clock only holds live timers.
//!
//! With the `tokio` feature, a [`Sleep`] first polled (and still pending) inside a tokio
//! runtime whose time driver is on waits on `tokio::time` instead, so a paused tokio clock
//! advances through it (see `tokio_clock`); everywhere else it uses this timer, unchanged.
//!
//! # What the timer guarantees
//!
//! - A registered waker is called once its deadline has passed, normally within a millisecond
//!   or two (the clock sleeps on a condition variable until the earliest deadline).
//! - Wakers are user code. The clock thread never calls one, so no waker can stop it; each
//!   call runs on a waker thread with its panic caught, so a panicking waker costs nothing but
//!   its own wake-up. No waker is called or dropped while the timer's lock is held, so a waker
//!   (or whatever dropping it releases: a task that owns another timed future) may use the
//!   timer again.
//! - A waker that blocks holds back only its own thread. When a due waker has waited
//!   [`STALL`] without a free waker thread, the clock starts another (up to [`MAX_WAKERS`]), so
//!   one slow waker delays unrelated timeouts by about [`STALL`], not by as long as it blocks.
//!   Waker threads beyond the first end after [`IDLE_EXIT`] without work.
//! - If the clock thread is ever gone (it runs no user code, so only an abort-class failure
//!   could end it), the next registration starts a new one.
//!
//! Under `--cfg loom` there is no timer thread: models use deadlines that have already passed
//! (a zero timeout), which complete on their first poll without registering.

use std::task::{Context, Poll, Waker};
use std::time::Instant;

#[cfg(not(loom))]
use std::collections::{BTreeMap, VecDeque};
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// How long a due waker may wait for a free waker thread before the clock starts another.
#[cfg(not(loom))]
pub(crate) const STALL: Duration = Duration::from_millis(2);
/// The most waker threads alive at once (each extra one exists only while others are stuck
/// in wakers that block).
#[cfg(not(loom))]
pub(crate) const MAX_WAKERS: usize = 64;
/// How long an extra waker thread waits for work before it ends.
#[cfg(not(loom))]
pub(crate) const IDLE_EXIT: Duration = Duration::from_secs(1);

/// The timer's state, under one lock that no user code ever runs (or is dropped) under.
#[cfg(not(loom))]
#[derive(Debug, Default)]
struct Timers {
    /// Keyed by deadline then registration number, so the first entry is the next to fire
    /// and equal deadlines keep their registration order.
    entries: BTreeMap<(Instant, u64), Waker>,
    next_id: u64,
    /// Wakers whose deadline passed, with that deadline, in deadline order.
    due: VecDeque<(Instant, Waker)>,
    /// Waker threads alive, and how many of them wait for work.
    wakers: usize,
    idle: usize,
    /// Whether the clock thread is running.
    clock_alive: bool,
}

#[cfg(not(loom))]
#[derive(Debug, Default)]
struct Timer {
    timers: Mutex<Timers>,
    /// The clock thread waits here for the next deadline (or an earlier registration).
    clock: Condvar,
    /// Idle waker threads wait here for due wakers.
    work: Condvar,
}

#[cfg(not(loom))]
static TIMER: OnceLock<&'static Timer> = OnceLock::new();

#[cfg(not(loom))]
impl Timer {
    /// The process-wide timer, locked, with its clock thread running.
    fn get() -> (&'static Timer, MutexGuard<'static, Timers>) {
        let timer: &'static Timer = TIMER.get_or_init(|| Box::leak(Box::default()));
        let mut timers = timer.lock();
        if !timers.clock_alive {
            // Spawned under the lock (once per process, in practice): the new thread's first
            // act is to take it. A spawn that fails (no thread left) panics nobody under the
            // lock: the next registration tries again.
            timers.clock_alive = std::thread::Builder::new()
                .name("abl-timer-clock".into())
                .spawn(move || timer.run_clock())
                .is_ok();
        }
        (timer, timers)
    }

    fn lock(&self) -> MutexGuard<'_, Timers> {
        crate::sync::unmodeled::lock(&self.timers)
    }

    /// The clock thread: moves passed deadlines to the due list and makes sure a waker thread
    /// takes them. It never calls or drops a waker.
    fn run_clock(&'static self) {
        /// Marks the clock gone if this thread ever ends, so the next registration restarts it.
        struct Alive(&'static Timer);
        impl Drop for Alive {
            fn drop(&mut self) {
                self.0.lock().clock_alive = false;
            }
        }
        let _alive = Alive(self);
        let mut timers = self.lock();
        loop {
            let now = Instant::now();
            while let Some(entry) = timers.entries.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let ((deadline, _), waker) = entry.remove_entry();
                timers.due.push_back((deadline, waker));
            }
            let mut recheck = None;
            if let Some(&(oldest, _)) = timers.due.front() {
                if timers.idle > 0 {
                    // Wake as many idle threads as there is work for.
                    for _ in 0..timers.due.len().min(timers.idle) {
                        self.work.notify_one();
                    }
                } else if timers.wakers < MAX_WAKERS
                    && (timers.wakers == 0 || now.saturating_duration_since(oldest) >= STALL)
                {
                    // Every waker thread is busy (one may be stuck in a waker that blocks):
                    // start another rather than let due wakers wait on it.
                    timers.wakers += 1;
                    if !self.spawn_waker(&mut timers) {
                        recheck = Some(now + STALL);
                    }
                } else {
                    recheck = Some(oldest + STALL);
                }
            }
            let next = timers.entries.first_key_value().map(|(&(at, _), _)| at);
            let wake_at = match (next, recheck) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            timers = match wake_at {
                Some(at) => {
                    let wait = at.saturating_duration_since(Instant::now());
                    self.clock
                        .wait_timeout(timers, wait)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
                None => self.clock.wait(timers).unwrap_or_else(|p| p.into_inner()),
            };
        }
    }

    /// Starts a waker thread (already counted in `wakers`); whether it started. If the thread
    /// cannot be spawned, the count is taken back (the clock tries again a stall later).
    fn spawn_waker(&'static self, timers: &mut Timers) -> bool {
        let spawned = std::thread::Builder::new()
            .name("abl-timer-waker".into())
            .spawn(move || self.run_waker())
            .is_ok();
        if !spawned {
            timers.wakers -= 1;
        }
        spawned
    }

    /// A waker thread: calls due wakers one at a time, each outside the lock and with its
    /// panic caught.
    fn run_waker(&'static self) {
        let mut timers = self.lock();
        loop {
            let Some((_, waker)) = timers.due.pop_front() else {
                timers.idle += 1;
                let (guard, wait) = self
                    .work
                    .wait_timeout(timers, IDLE_EXIT)
                    .unwrap_or_else(|p| p.into_inner());
                timers = guard;
                timers.idle -= 1;
                if wait.timed_out() && timers.due.is_empty() && timers.wakers > 1 {
                    timers.wakers -= 1;
                    return;
                }
                continue;
            };
            drop(timers);
            crate::contain::contain(|| waker.wake());
            timers = self.lock();
        }
    }
}

#[cfg(all(feature = "tokio", not(loom)))]
mod tokio_clock;

/// A deadline a future can wait for.
#[derive(Debug)]
pub(crate) struct Sleep {
    deadline: Instant,
    /// The registration, while one is live.
    key: Option<(Instant, u64)>,
    /// Which clock the sleep waits on (tokio's, once chosen, or this timer).
    #[cfg(all(feature = "tokio", not(loom)))]
    clock: tokio_clock::Clock,
}

impl Sleep {
    /// A sleep of `timeout` from `start` (`None` if that instant is too far to represent: no
    /// deadline). On tokio's clock (feature `tokio`) the timeout counts from tokio's "now" at
    /// this call, which a paused clock holds still.
    pub(crate) fn after(start: Instant, timeout: Duration) -> Option<Sleep> {
        let deadline = start.checked_add(timeout)?;
        Some(Sleep {
            deadline,
            key: None,
            #[cfg(all(feature = "tokio", not(loom)))]
            clock: tokio_clock::Clock::after(timeout),
        })
    }

    /// The deadline by the std clock (what blocking waits use).
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Ready once the deadline has passed; otherwise makes sure the task of `cx` is woken at
    /// the deadline.
    pub(crate) fn poll_elapsed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        // On tokio's clock, only tokio's clock decides (a paused clock holds the deadline off
        // however long the test takes in real time).
        #[cfg(all(feature = "tokio", not(loom)))]
        if let Some(poll) = self.clock.poll(cx) {
            return poll;
        }
        let now = Instant::now();
        if now >= self.deadline {
            self.cancel();
            return Poll::Ready(());
        }
        // The first time it would register: tokio's clock if this task runs inside a tokio
        // runtime with a time driver, else this timer from now on.
        #[cfg(all(feature = "tokio", not(loom)))]
        if self.key.is_none()
            && self.clock.choose(self.deadline - now)
            && let Some(poll) = self.clock.poll(cx)
        {
            return poll;
        }
        self.register(cx.waker());
        Poll::Pending
    }

    #[cfg(not(loom))]
    fn register(&mut self, waker: &Waker) {
        let (timer, mut timers) = Timer::get();
        if let Some(key) = self.key
            && let Some(registered) = timers.entries.get_mut(&key)
        {
            if registered.will_wake(waker) {
                return;
            }
            // The replaced waker is dropped after the lock is released: it may own the last
            // reference to a task whose drop cancels another timer.
            let replaced = core::mem::replace(registered, waker.clone());
            drop(timers);
            drop(replaced);
            return;
        }
        let key = (self.deadline, timers.next_id);
        timers.next_id += 1;
        let earliest = timers
            .entries
            .first_key_value()
            .is_none_or(|(first, _)| key < *first);
        timers.entries.insert(key, waker.clone());
        self.key = Some(key);
        drop(timers);
        if earliest {
            timer.clock.notify_one();
        }
    }

    #[cfg(loom)]
    fn register(&mut self, _waker: &Waker) {
        panic!("timers are not modelled under loom: use a zero timeout in loom models");
    }

    /// Removes the registration, if any.
    pub(crate) fn cancel(&mut self) {
        #[cfg(all(feature = "tokio", not(loom)))]
        self.clock.cancel();
        let key = self.key.take();
        #[cfg(loom)]
        debug_assert!(key.is_none(), "nothing registers under loom");
        #[cfg(not(loom))]
        if let Some(key) = key
            && let Some(timer) = TIMER.get()
        {
            // Dropped after the lock is released (see `register`).
            let removed = timer.lock().entries.remove(&key);
            drop(removed);
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.cancel();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use super::*;

    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn wakes_at_the_deadline_and_forgets_cancelled_timers() {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);

        let mut soon = Sleep::after(Instant::now(), Duration::from_millis(20)).unwrap();
        let mut cancelled = Sleep::after(Instant::now(), Duration::from_millis(10)).unwrap();
        assert!(soon.poll_elapsed(&mut cx).is_pending());
        assert!(cancelled.poll_elapsed(&mut cx).is_pending());
        drop(cancelled);
        let started = Instant::now();
        while count.0.load(Ordering::SeqCst) == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "timer never fired"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(Instant::now() >= soon.deadline());
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "only the live timer fired"
        );
        assert!(soon.poll_elapsed(&mut cx).is_ready());
    }

    #[test]
    fn a_passed_deadline_is_ready_without_registering() {
        let mut cx = Context::from_waker(Waker::noop());
        let mut past = Sleep::after(Instant::now(), Duration::ZERO).unwrap();
        assert!(past.poll_elapsed(&mut cx).is_ready());
        assert!(past.key.is_none());
    }
}
