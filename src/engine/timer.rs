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
//! - A waker that blocks holds back only its own thread. The waker threads free for due wakers
//!   are the idle ones and the ones just started (each takes a due waker before it can block in
//!   one); busy threads do not count, as any of them may be stuck. While due wakers remain
//!   beyond the free threads, the clock looks again at most [`STALL`] after the oldest of them
//!   fell due, and then starts a thread for every one that has waited [`STALL`], all at once
//!   (up to [`MAX_WAKERS`] threads). So while fewer than [`MAX_WAKERS`] wakers block at once,
//!   they delay an unrelated timeout by about [`STALL`], not by as long as they block.
//!   Measured (`tests/waiting/timer_wakers.rs`, wakers due 10 ms before an unrelated 20 ms
//!   timeout): behind 2 wakers blocking 300 ms, or 40 blocking 150 ms, it fired about 2.4 ms
//!   late with the threads still to start, 0.2 to 0.4 ms late with them idle. Waker threads
//!   beyond the first end after [`IDLE_EXIT`] without work.
//! - Past the cap, when [`MAX_WAKERS`] or more wakers block at once, every waker thread is
//!   stuck and due wakers wait, in deadline order, for one to come free (a thread that comes
//!   free takes the next due waker itself; the clock could do nothing sooner, so it does not
//!   look again for them). An unrelated timeout waits until a thread comes free for it: up to
//!   the shortest remaining block when fewer than [`MAX_WAKERS`] wakers wait before it, and one
//!   more block for every further [`MAX_WAKERS`] of them that block too. Measured (same test
//!   file): behind 70 wakers blocking 300 ms, it fired 293 ms late (the shortest remaining
//!   block); behind 200 wakers blocking 100 ms, also 293 ms late (the 136 past the cap took the
//!   freed threads in two turns before its own, the third).
//! - If the clock thread is ever gone (it runs no user code, so only an abort-class failure
//!   could end it), the next registration starts a new one.
//!
//! Under `--cfg loom` there is no timer thread: models use deadlines that have already passed
//! (a zero timeout), which complete on their first poll without registering.

use std::task::{Context, Poll, Waker};
use std::time::Instant;

#[cfg(not(loom))]
use crate::support::sync::unmodeled::{Condvar, Mutex, MutexGuard, OnceLock};
#[cfg(not(loom))]
use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

/// How long a due waker may wait for a free waker thread before the clock starts one for it
/// (the clock looks again at most this long after such a waker fell due).
#[cfg(not(loom))]
pub(crate) const STALL: Duration = Duration::from_millis(2);
/// The most waker threads alive at once (each extra one exists only while others are stuck
/// in wakers that block, or were while due wakers waited a stall for them).
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
    /// Waker threads alive; how many of them wait for work; and how many the clock started
    /// that have not yet taken the lock. An idle or a starting thread takes a due waker (from
    /// the front) before it can block in one: those are the threads free for due wakers.
    wakers: usize,
    idle: usize,
    starting: usize,
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
        crate::support::sync::unmodeled::lock(&self.timers)
    }

    /// The clock thread: moves passed deadlines to the due list and makes sure waker threads
    /// take them. It never calls or drops a waker.
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
            let (start, mut recheck) = self.provide(&mut timers, now);
            if start > 0 {
                // Spawned outside the lock: starting dozens of threads takes milliseconds, which
                // registrations, cancellations and waker threads coming back for work would
                // spend waiting for it. The threads are already counted (in `wakers` and
                // `starting`), so a waker thread that comes free meanwhile sees the true
                // numbers and a new thread simply waits for the lock. A registration that
                // notifies the clock meanwhile wakes nobody, but is not lost: the clock reads
                // the entries again, under the lock, before it waits.
                drop(timers);
                let started = (0..start).take_while(|_| self.spawn_waker()).count();
                timers = self.lock();
                if started < start {
                    // No thread left to start (the rest would fail too): take the count back,
                    // and try again a stall later for the due wakers left without a thread.
                    timers.wakers -= start - started;
                    timers.starting -= start - started;
                    let retry = Instant::now() + STALL;
                    recheck = Some(recheck.map_or(retry, |at| at.min(retry)));
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

    /// Provides the due wakers with threads, as the clock sees them at `now`: wakes an idle
    /// waker thread for each due waker it can, and counts (in `wakers` and `starting`) a new
    /// thread for each further one that has waited [`STALL`], up to [`MAX_WAKERS`]. Returns
    /// how many threads the clock must start, and when it must look again: when the oldest due
    /// waker still left without a thread will have waited [`STALL`].
    ///
    /// Busy threads do not count: each may be stuck in a waker that blocks. Without the
    /// recheck, due wakers beyond the threads provided would wait for the next deadline (or
    /// forever, with none registered) while the threads provided block in the wakers ahead
    /// of them; and starting one thread per look would let each slow waker in a row cost the
    /// rest another look.
    fn provide(&self, timers: &mut Timers, now: Instant) -> (usize, Option<Instant>) {
        let due = timers.due.len();
        // Wake as many idle threads as there is work for. One woken earlier that has not yet
        // taken the lock still counts as idle and may be notified again: the extra
        // notification wakes another idle thread for nothing, or nobody.
        for _ in 0..due.min(timers.idle) {
            self.work.notify_one();
        }
        let free = (timers.idle + timers.starting).min(due);
        // A thread for each due waker past the free ones that has waited a stall (the list is
        // in deadline order, so those come first); with no waker thread at all, the first
        // starts at once.
        let none_alive = timers.wakers == 0;
        let start = timers
            .due
            .iter()
            .skip(free)
            .take(MAX_WAKERS - timers.wakers)
            .enumerate()
            .take_while(|&(i, &(deadline, _))| {
                (i == 0 && none_alive) || now.saturating_duration_since(deadline) >= STALL
            })
            .count();
        timers.wakers += start;
        timers.starting += start;
        let recheck = match timers.due.get(free + start) {
            // At the cap no thread can be started, and no thread ends while wakers are due:
            // the next busy one to come free takes this waker (or one before it) itself, and
            // nothing the clock could do would be sooner.
            Some(_) if timers.wakers == MAX_WAKERS => None,
            // Not yet a stall old. Its deadline has passed, so this is at most a stall from
            // now; the threads provided may take it first, and then the look finds no work.
            Some(&(deadline, _)) => Some(deadline + STALL),
            None => None,
        };
        (start, recheck)
    }

    /// Starts a waker thread (already counted in `wakers` and `starting`); whether it started.
    fn spawn_waker(&'static self) -> bool {
        std::thread::Builder::new()
            .name("abl-timer-waker".into())
            .spawn(move || self.run_waker())
            .is_ok()
    }

    /// A waker thread: calls due wakers one at a time, each outside the lock and with its
    /// panic caught.
    fn run_waker(&'static self) {
        let mut timers = self.lock();
        timers.starting -= 1;
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
            crate::support::contain::contain(|| waker.wake());
            timers = self.lock();
        }
    }
}

#[cfg(all(feature = "tokio", not(loom)))]
mod tokio_clock;

/// How long a queued call may wait: a timeout counted from joining the queue and a deadline,
/// whichever comes first (neither: as long as it takes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bound {
    pub(crate) timeout: Option<Duration>,
    pub(crate) deadline: Option<Instant>,
}

impl Bound {
    /// Whether the wait has an end (if not, nobody reads the clock for it).
    #[inline]
    pub(crate) fn is_bounded(&self) -> bool {
        self.timeout.is_some() || self.deadline.is_some()
    }

    /// The sleep of a call that joined the queue at `queued_at` (`None`: no end, or one too
    /// far to represent). A deadline already past ends the wait at once.
    pub(crate) fn sleep(self, queued_at: Instant) -> Option<Sleep> {
        let budget = self
            .deadline
            .map(|deadline| deadline.saturating_duration_since(queued_at));
        let timeout = match (self.timeout, budget) {
            (Some(timeout), Some(budget)) => Some(timeout.min(budget)),
            (timeout, budget) => timeout.or(budget),
        };
        timeout.and_then(|timeout| Sleep::after(queued_at, timeout))
    }
}

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
    use crate::support::sync::unmodeled::{Arc, AtomicU64, Ordering};
    use std::task::Wake;

    use super::*;

    struct Count(AtomicU64);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn wakes_at_the_deadline_and_forgets_cancelled_timers() {
        let count = Arc::new(Count(AtomicU64::new(0)));
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

    /// A timer of its own (not the process-wide one) with `due` wakers that fell due `ago`.
    fn with_due(due: usize, ago: Duration, now: Instant) -> Timer {
        let timer = Timer::default();
        timer.lock().due = (0..due)
            .map(|_| (now - ago, Waker::noop().clone()))
            .collect();
        timer
    }

    #[test]
    fn due_wakers_left_without_a_thread_get_one_each_at_once_after_a_stall() {
        let now = Instant::now();
        let stall_ago = STALL + Duration::from_millis(1);

        // No waker thread at all: the first starts at once; the clock looks again when the
        // next due waker will have waited a stall.
        let timer = with_due(3, Duration::ZERO, now);
        let mut timers = timer.lock();
        assert_eq!(timer.provide(&mut timers, now), (1, Some(now + STALL)));
        assert_eq!((timers.wakers, timers.starting), (1, 1));
        // Looked at again before the stall: the started thread is free for one, nothing more.
        assert_eq!(timer.provide(&mut timers, now), (0, Some(now + STALL)));
        drop(timers);

        // 40 due wakers that have waited a stall, the one thread busy: 40 threads at once.
        let timer = with_due(40, stall_ago, now);
        let mut timers = timer.lock();
        timers.wakers = 1;
        assert_eq!(timer.provide(&mut timers, now), (40, None));
        assert_eq!((timers.wakers, timers.starting), (41, 40));
        // Those 40 are free for them: none more.
        assert_eq!(timer.provide(&mut timers, now), (0, None));
        drop(timers);

        // Idle and starting threads take the first due wakers; a thread for each of the rest.
        let timer = with_due(5, stall_ago, now);
        let mut timers = timer.lock();
        (timers.wakers, timers.idle, timers.starting) = (4, 2, 1);
        assert_eq!(timer.provide(&mut timers, now), (2, None));
        assert_eq!((timers.wakers, timers.starting), (6, 3));
        drop(timers);

        // Up to the cap, and then no look again: a busy thread that comes free takes the rest.
        let timer = with_due(10, stall_ago, now);
        let mut timers = timer.lock();
        timers.wakers = MAX_WAKERS - 3;
        assert_eq!(timer.provide(&mut timers, now), (3, None));
        assert_eq!(timers.wakers, MAX_WAKERS);
    }

    #[test]
    fn a_passed_deadline_is_ready_without_registering() {
        let mut cx = Context::from_waker(Waker::noop());
        let mut past = Sleep::after(Instant::now(), Duration::ZERO).unwrap();
        assert!(past.poll_elapsed(&mut cx).is_ready());
        assert!(past.key.is_none());
    }
}
