//! A runtime-agnostic timer for queue timeouts and bounded drains: one background thread,
//! started on first use, that wakes registered tasks at their deadlines.
//!
//! Futures of this crate must time out on tokio (current-thread and multi-thread), smol,
//! async-std and a plain `block_on` without a runtime feature, so they cannot borrow a
//! runtime's timer. The thread sleeps on a condition variable until the earliest deadline (or
//! until an earlier one is registered), then wakes every task whose deadline passed; wakers are
//! called with the lock released. A [`Sleep`] registers only while it is pending and
//! deregisters when it completes or is dropped, so the thread only holds live timers.
//!
//! Under `--cfg loom` there is no timer thread: models use deadlines that have already passed
//! (a zero timeout), which complete on their first poll without registering.

use std::task::{Context, Poll, Waker};
use std::time::Instant;

#[cfg(not(loom))]
use std::collections::BTreeMap;
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex, OnceLock};

/// The timer thread's state: pending deadlines, each with the waker to call.
#[cfg(not(loom))]
#[derive(Debug, Default)]
struct Timers {
    /// Keyed by deadline then registration number, so the first entry is the next to fire
    /// and equal deadlines keep their registration order.
    entries: BTreeMap<(Instant, u64), Waker>,
    next_id: u64,
}

#[cfg(not(loom))]
#[derive(Debug, Default)]
struct TimerThread {
    timers: Mutex<Timers>,
    wakeup: Condvar,
}

#[cfg(not(loom))]
static THREAD: OnceLock<&'static TimerThread> = OnceLock::new();

#[cfg(not(loom))]
fn timer_thread() -> &'static TimerThread {
    THREAD.get_or_init(|| {
        let shared: &'static TimerThread = Box::leak(Box::default());
        std::thread::Builder::new()
            .name("async-bulkhead-llm-timer".into())
            .spawn(move || run(shared))
            .expect("failed to spawn the async-bulkhead-llm timer thread");
        shared
    })
}

#[cfg(not(loom))]
fn run(shared: &'static TimerThread) -> ! {
    let mut due = Vec::new();
    let mut timers = crate::sync::unmodeled::lock(&shared.timers);
    loop {
        let now = Instant::now();
        while let Some(entry) = timers.entries.first_entry() {
            if entry.key().0 > now {
                break;
            }
            due.push(entry.remove());
        }
        if !due.is_empty() {
            // Never wake under the lock: a waker may poll the future on this very thread
            // (a `block_on` executor), which would try to take the lock again.
            drop(timers);
            due.drain(..).for_each(Waker::wake);
            timers = crate::sync::unmodeled::lock(&shared.timers);
            continue;
        }
        timers = match timers.entries.first_key_value() {
            Some((&(deadline, _), _)) => {
                let wait = deadline.saturating_duration_since(now);
                shared
                    .wakeup
                    .wait_timeout(timers, wait)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
            None => shared
                .wakeup
                .wait(timers)
                .unwrap_or_else(|p| p.into_inner()),
        };
    }
}

/// A deadline a future can wait for.
#[derive(Debug)]
pub(crate) struct Sleep {
    deadline: Instant,
    /// The registration, while one is live.
    key: Option<(Instant, u64)>,
}

impl Sleep {
    pub(crate) fn until(deadline: Instant) -> Sleep {
        Sleep {
            deadline,
            key: None,
        }
    }

    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Ready once the deadline has passed; otherwise makes sure the task of `cx` is woken at
    /// the deadline.
    pub(crate) fn poll_elapsed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            self.cancel();
            return Poll::Ready(());
        }
        self.register(cx.waker());
        Poll::Pending
    }

    #[cfg(not(loom))]
    fn register(&mut self, waker: &Waker) {
        let shared = timer_thread();
        let mut timers = crate::sync::unmodeled::lock(&shared.timers);
        if let Some(key) = self.key
            && let Some(registered) = timers.entries.get_mut(&key)
        {
            if !registered.will_wake(waker) {
                registered.clone_from(waker);
            }
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
            shared.wakeup.notify_one();
        }
    }

    #[cfg(loom)]
    fn register(&mut self, _waker: &Waker) {
        panic!("timers are not modelled under loom: use a zero timeout in loom models");
    }

    /// Removes the registration, if any.
    pub(crate) fn cancel(&mut self) {
        let key = self.key.take();
        #[cfg(loom)]
        debug_assert!(key.is_none(), "nothing registers under loom");
        #[cfg(not(loom))]
        if let Some(key) = key
            && let Some(shared) = THREAD.get()
        {
            crate::sync::unmodeled::lock(&shared.timers)
                .entries
                .remove(&key);
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
    use std::time::Duration;

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

        let mut soon = Sleep::until(Instant::now() + Duration::from_millis(20));
        let mut cancelled = Sleep::until(Instant::now() + Duration::from_millis(10));
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
        let mut past = Sleep::until(Instant::now());
        assert!(past.poll_elapsed(&mut cx).is_ready());
        assert!(past.key.is_none());
    }
}
