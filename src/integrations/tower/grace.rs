//! What the LLM layer does when a client goes away mid-response ([`Disconnect`]), and the
//! grace hold behind it: an admitted call's permit kept for a while after its response body
//! was dropped, then released by the crate's timer (no runtime, no task: the timer wakes a
//! waker that releases).
//!
//! Why hold at all: a proxy's client disconnecting drops the upstream request, but the
//! provider finds out only when it next writes to the closed connection, and keeps generating
//! until then. Releasing at once lets the next call in while the provider still runs the
//! last one, so the provider may see more calls at once than the limit while clients drop
//! their streams.

use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Wake, Waker};
use std::time::{Duration, Instant};

use crate::engine::timer::Sleep;

/// What [`LlmLayer`](crate::tower::LlmLayer) does with an admitted call whose client went
/// away before its response ended (the response body dropped mid-stream).
///
/// Measured (the crate's test `tests/tower/disconnect.rs`, a real server on loopback): a limit
/// of 8, 48 clients for 1.5 s of which half leave after 3 tokens, a provider that generates
/// every call to its end (15-30 tokens, 10 ms apart: at most 300 ms) whether or not anyone
/// reads it, the worst case. Over six runs the provider ran at most **21-24 calls at once with
/// `Release`** (136-149 calls served), **8 with `Hold(350 ms)`** (a hold as long as the
/// longest generation plus a margin for late timers: exact, but 88-91 calls served, since a
/// slot waits out the generation its client left) and 14-17 with `Measured { max: 300 ms }`
/// (106-115 calls: the average hold undershoots a long generation). A hold of exactly the
/// longest generation (300 ms) once let 9 through: timers fire late.
///
/// The default stays `Release`: it never holds capacity for nobody, and most gateways set
/// their limit below what the provider allows. When the limit *is* the provider's hard limit
/// (an account's concurrency, a self-hosted model's batch size), use `Hold` with about the
/// provider's longest generation (its p99 time to the last token): then the provider never
/// runs more calls than the limit.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::{LlmBulkhead, tower::{Disconnect, LlmLayer}};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 32).build()?;
/// // Keep a slot for up to 30 s after a disconnect, as long as calls lately took.
/// let layer = LlmLayer::new(bulkhead).on_disconnect(Disconnect::Measured {
///     max: Duration::from_secs(30),
/// });
/// # let _ = layer;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Disconnect {
    /// Release at once (the default): capacity is never held for a client that left, at the
    /// price of the provider running a call beyond the limit until it notices.
    #[default]
    Release,
    /// Keep the permit this long after the disconnect, then release it.
    Hold(Duration),
    /// Keep the permit for what a call lately took to end, less what this one already took
    /// (the layer's recent average hold time), at most `max`: about when the provider would
    /// have finished it. Nothing until a call was released.
    Measured {
        /// The longest hold.
        max: Duration,
    },
}

impl Disconnect {
    /// How long to keep a call admitted at `admitted_at` whose client left now, given the
    /// recent average hold (`None` until a call was released).
    pub(super) fn grace(self, admitted_at: Option<Instant>, average: Option<Duration>) -> Duration {
        match self {
            Disconnect::Release => Duration::ZERO,
            Disconnect::Hold(grace) => grace,
            Disconnect::Measured { max } => {
                let held = admitted_at.map_or(Duration::ZERO, |at| at.elapsed());
                average.map_or(Duration::ZERO, |average| {
                    average.saturating_sub(held).min(max)
                })
            }
        }
    }
}

/// Keeps `held` (whose drop releases) for `grace`, then drops it on the timer's thread.
pub(super) fn hold_for<T: Send + 'static>(held: T, grace: Duration) {
    let Some(sleep) = Sleep::after(Instant::now(), grace) else {
        return; // too far to represent: released now
    };
    let parked = Arc::new(Parked {
        held: Mutex::new(Some((held, sleep))),
    });
    parked.check();
}

/// A held value and its deadline, woken by the timer.
struct Parked<T> {
    held: Mutex<Option<(T, Sleep)>>,
}

impl<T: Send + 'static> Parked<T> {
    /// Drops the value once the deadline passed; else waits for the timer to wake this again.
    fn check(self: &Arc<Self>) {
        let waker = Waker::from(Arc::clone(self));
        let mut cx = Context::from_waker(&waker);
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let due = held
            .as_mut()
            .is_some_and(|(_, sleep)| sleep.poll_elapsed(&mut cx).is_ready());
        let released = if due { held.take() } else { None };
        drop(held);
        // Released outside the lock: the release announces events to listeners.
        drop(released);
    }
}

impl<T: Send + 'static> Wake for Parked<T> {
    fn wake(self: Arc<Self>) {
        self.check();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.check();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{Disconnect, hold_for};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn the_grace_of_each_policy() {
        let s = Duration::from_secs;
        let max = Disconnect::Measured { max: s(10) };
        assert_eq!(Disconnect::Release.grace(None, Some(s(5))), Duration::ZERO);
        assert_eq!(Disconnect::Hold(s(3)).grace(None, None), s(3));
        assert_eq!(max.grace(None, None), Duration::ZERO); // nothing measured yet
        assert_eq!(max.grace(None, Some(s(20))), s(10)); // capped
        let admitted = Instant::now().checked_sub(s(2)).unwrap();
        let grace = max.grace(Some(admitted), Some(s(5)));
        assert!(grace <= s(3) && grace > s(2), "{grace:?}"); // what is left of the average
        assert_eq!(max.grace(Some(admitted), Some(s(1))), Duration::ZERO); // already longer
    }

    /// Drops what it holds when dropped.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_held_value_is_dropped_by_the_timer_after_its_grace() {
        let dropped = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        hold_for(Flag(dropped.clone()), Duration::from_millis(60));
        assert!(!dropped.load(Ordering::SeqCst));
        while !dropped.load(Ordering::SeqCst) {
            assert!(started.elapsed() < Duration::from_secs(5), "never dropped");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(started.elapsed() >= Duration::from_millis(60));
    }
}
