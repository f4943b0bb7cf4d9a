//! Tokio's clock for a [`Sleep`](super::Sleep) (feature `tokio`): which clock a sleep waits
//! on, and the probe that tells whether the current tokio runtime has a time driver.
//!
//! A sleep chooses its clock the first time it would register (its first pending poll), in
//! the context of the task polling it: inside a tokio runtime whose time driver is on, it
//! waits on `tokio::time::sleep_until`, so a paused clock (`#[tokio::test(start_paused =
//! true)]`, `tokio::time::pause`) auto-advances to its deadline while the runtime is idle;
//! anywhere else (no runtime, a runtime built without `enable_time`, another executor) it
//! uses the crate's own timer, exactly as without the feature. "Inside a tokio runtime" means
//! what `tokio::runtime::Handle::try_current` says: a thread in that runtime's context. Another
//! executor's `block_on` run on such a thread (inside `Runtime::enter`, or nested in a tokio
//! task) would pick tokio's clock that nothing drives there: its timeouts would not fire.
//!
//! # Detecting the time driver
//!
//! tokio offers no query for whether the current runtime's time driver is enabled: creating a
//! `tokio::time::Sleep` without one panics ("timers are disabled"), which tokio documents under
//! *Panics* of `sleep_until`. So the sleep is created under `catch_unwind` (through
//! [`contain`](crate::support::contain::contain)); a runtime found without a time driver is remembered
//! by its [`Id`](tokio::runtime::Id) (the last [`REMEMBERED`] such runtimes), so each one is
//! probed once and the panic hook reports that one probe only (sleeps made at the same moment
//! on several threads may each probe, and each such panic reaches the hook). Runtimes with a time driver
//! never panic, so they need no memory. Under `panic = "abort"` no panic can be caught: there
//! the crate's own timer is always used.
//!
//! A tokio sleep polled after its runtime shut down panics too; that poll is caught the same
//! way and the sleep falls back to the crate's timer for the rest of its wait.

use crate::support::sync::unmodeled::{AtomicBool, Mutex, Ordering};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::runtime::{Handle, Id};

use crate::support::contain::contain;

/// How many runtimes without a time driver are remembered (older ones are probed again if a
/// sleep ever runs in them).
pub(super) const REMEMBERED: usize = 64;

/// Runtimes found without a time driver, oldest first.
static WITHOUT_TIME: Mutex<VecDeque<Id>> = Mutex::new(VecDeque::new());
/// Whether `WITHOUT_TIME` was ever written: until then no sleep takes its lock.
static ANY_WITHOUT_TIME: AtomicBool = AtomicBool::new(false);

/// The clock a sleep waits on.
#[derive(Debug)]
pub(super) enum Clock {
    /// Not chosen yet: the sleep has not registered. With tokio's deadline (the timeout
    /// counted from tokio's "now" when the sleep was made); `None` if that is too far for
    /// tokio's clock (what remains by the std clock when the clock is chosen is used then).
    Unchosen(Option<tokio::time::Instant>),
    /// The crate's own timer.
    Own,
    /// Tokio's timer.
    Tokio(Pin<Box<tokio::time::Sleep>>),
}

impl Clock {
    pub(super) fn after(timeout: Duration) -> Clock {
        Clock::Unchosen(tokio::time::Instant::now().checked_add(timeout))
    }

    /// On tokio's clock, whether its deadline passed (registering `cx` if not); `None`
    /// otherwise, or if tokio's timer failed (its runtime shut down): the crate's timer decides.
    pub(super) fn poll(&mut self, cx: &mut Context<'_>) -> Option<Poll<()>> {
        let Clock::Tokio(sleep) = self else {
            return None;
        };
        let mut polled = None;
        if contain(|| polled = Some(sleep.as_mut().poll(cx))) {
            *self = Clock::Own;
        }
        polled
    }

    /// Chooses the clock if not chosen yet (`remaining`: the time left by the std clock);
    /// returns whether it is tokio's.
    pub(super) fn choose(&mut self, remaining: Duration) -> bool {
        match self {
            Clock::Tokio(_) => true,
            Clock::Own => false,
            Clock::Unchosen(deadline) => match tokio_sleep(*deadline, remaining) {
                Some(sleep) => {
                    *self = Clock::Tokio(sleep);
                    true
                }
                None => {
                    *self = Clock::Own;
                    false
                }
            },
        }
    }

    /// Drops tokio's registration, if any, keeping its deadline for a later poll.
    pub(super) fn cancel(&mut self) {
        if let Clock::Tokio(sleep) = self {
            *self = Clock::Unchosen(Some(sleep.deadline()));
        }
    }
}

/// A tokio sleep until `deadline` (or `remaining` from tokio's now), if this thread runs
/// inside a tokio runtime with a time driver.
fn tokio_sleep(
    deadline: Option<tokio::time::Instant>,
    remaining: Duration,
) -> Option<Pin<Box<tokio::time::Sleep>>> {
    if cfg!(panic = "abort") {
        return None;
    }
    let id = Handle::try_current().ok()?.id();
    // Relaxed: the list itself is read under its lock; a stale `false` costs one more probe.
    if ANY_WITHOUT_TIME.load(Ordering::Relaxed)
        && crate::support::sync::unmodeled::lock(&WITHOUT_TIME).contains(&id)
    {
        return None;
    }
    // Overflow: the deadline is too far for tokio's clock; the crate's timer handles it.
    let deadline = deadline.or_else(|| tokio::time::Instant::now().checked_add(remaining))?;
    let mut sleep = None;
    if contain(|| sleep = Some(tokio::time::sleep_until(deadline))) {
        // No time driver. The lock is taken after the panic was caught, never under it.
        let mut without = crate::support::sync::unmodeled::lock(&WITHOUT_TIME);
        if !without.contains(&id) {
            if without.len() == REMEMBERED {
                without.pop_front();
            }
            without.push_back(id);
        }
        ANY_WITHOUT_TIME.store(true, Ordering::Relaxed);
        return None;
    }
    sleep.map(Box::pin)
}

#[cfg(test)]
mod tests {
    use std::task::Waker;
    use std::time::Instant;

    use super::super::Sleep;
    use super::*;

    fn without_time() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    }

    #[test]
    fn no_runtime_means_the_crates_timer() {
        let mut sleep = Sleep::after(Instant::now(), Duration::from_secs(60)).unwrap();
        let mut cx = Context::from_waker(Waker::noop());
        assert!(sleep.poll_elapsed(&mut cx).is_pending());
        assert!(matches!(sleep.clock, Clock::Own));
        assert!(sleep.key.is_some());
    }

    #[test]
    fn a_runtime_without_time_is_probed_once_and_remembered() {
        let rt = without_time();
        let id = rt.handle().id();
        let _in = rt.enter();
        let mut cx = Context::from_waker(Waker::noop());
        for _ in 0..2 {
            let mut sleep = Sleep::after(Instant::now(), Duration::from_secs(60)).unwrap();
            assert!(sleep.poll_elapsed(&mut cx).is_pending());
            assert!(matches!(sleep.clock, Clock::Own));
            assert!(sleep.key.is_some());
        }
        let without = crate::support::sync::unmodeled::lock(&WITHOUT_TIME);
        assert_eq!(without.iter().filter(|&&known| known == id).count(), 1);
    }

    #[test]
    fn a_runtime_with_time_uses_tokios_clock_and_cancel_keeps_its_deadline() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("runtime");
        rt.block_on(async {
            let started = tokio::time::Instant::now();
            let mut sleep = Sleep::after(Instant::now(), Duration::from_secs(60)).unwrap();
            let mut cx = Context::from_waker(Waker::noop());
            assert!(sleep.poll_elapsed(&mut cx).is_pending());
            let Clock::Tokio(inner) = &sleep.clock else {
                panic!("not on tokio's clock: {:?}", sleep.clock);
            };
            assert_eq!(inner.deadline(), started + Duration::from_secs(60));
            assert!(sleep.key.is_none(), "nothing registered with the crate's timer");
            sleep.cancel();
            assert!(matches!(sleep.clock, Clock::Unchosen(Some(at)) if at == started + Duration::from_secs(60)));
            // Awaited: the paused clock jumps to the deadline.
            core::future::poll_fn(|cx| sleep.poll_elapsed(cx)).await;
            assert_eq!(started.elapsed(), Duration::from_secs(60));
        });
    }

    #[test]
    fn a_tokio_sleep_outliving_its_runtime_falls_back_to_the_crates_timer() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let mut sleep = Sleep::after(Instant::now(), Duration::from_millis(30)).unwrap();
        let mut cx = Context::from_waker(Waker::noop());
        rt.block_on(async { assert!(sleep.poll_elapsed(&mut cx).is_pending()) });
        assert!(matches!(sleep.clock, Clock::Tokio(_)));
        drop(rt);
        let started = Instant::now();
        futures::executor::block_on(core::future::poll_fn(|cx| sleep.poll_elapsed(cx)));
        assert!(matches!(sleep.clock, Clock::Own));
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
