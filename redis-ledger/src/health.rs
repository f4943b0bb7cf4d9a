//! Whether Redis answers: set down by a failed call, up by an answer. While down, calls skip
//! Redis (straight to the failure policy) except one every `retry_every`, so an outage costs
//! one timeout per retry period, not one per call.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub(crate) struct Health {
    epoch: Instant,
    down: AtomicBool,
    /// Milliseconds since `epoch` before which calls do not try Redis.
    retry_at: AtomicU64,
    retry_every: Duration,
}

impl Health {
    pub(crate) fn new(retry_every: Duration) -> Health {
        Health {
            epoch: Instant::now(),
            down: AtomicBool::new(false),
            retry_at: AtomicU64::new(0),
            retry_every,
        }
    }

    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a call should try Redis now (always while up; once per retry period while
    /// down: the caller that wins the retry slot tries).
    pub(crate) fn should_try(&self) -> bool {
        if !self.down.load(Ordering::Acquire) {
            return true;
        }
        let now = self.now();
        let at = self.retry_at.load(Ordering::Acquire);
        now >= at
            && self
                .retry_at
                .compare_exchange(
                    at,
                    now + millis(self.retry_every),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    /// Redis answered: whether it had been down (one caller sees the change).
    pub(crate) fn up(&self) -> bool {
        self.down.load(Ordering::Relaxed) && self.down.swap(false, Ordering::AcqRel)
    }

    /// A call failed: skip Redis until the retry period has passed. Whether it had been up
    /// (one caller sees the change).
    pub(crate) fn down(&self) -> bool {
        self.retry_at
            .store(self.now() + millis(self.retry_every), Ordering::Release);
        !self.down.swap(true, Ordering::AcqRel)
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
