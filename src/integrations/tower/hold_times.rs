//! The recent hold time of the calls a tower layer released ([`HoldTimes`]): the history
//! behind the opt-in `Retry-After` hint of both layers (the LLM layer's and the general
//! bulkhead's). A hint, never a promise: it says how long calls held their slot lately, not
//! when one will be free.

use crate::support::sync::unmodeled::{AtomicU64, Ordering};
use std::time::Duration;

/// The recent hold time of the calls a layer released: an exponentially weighted average
/// (weight 1/8 for each new call), in microseconds, 0 until the first release.
#[derive(Default)]
pub(crate) struct HoldTimes {
    average_micros: AtomicU64,
}

impl HoldTimes {
    /// Adds one call's hold (from its admission to its release).
    pub(crate) fn record(&self, held: Duration) {
        let micros = u64::try_from(held.as_micros()).unwrap_or(u64::MAX).max(1);
        // Relaxed: a hint; a lost update only skips one sample.
        let old = self.average_micros.load(Ordering::Relaxed);
        let new = if old == 0 {
            micros
        } else {
            old - old / 8 + micros / 8
        };
        self.average_micros.store(new, Ordering::Relaxed);
    }

    /// The average; `None` until a call was released.
    pub(crate) fn average(&self) -> Option<Duration> {
        let micros = self.average_micros.load(Ordering::Relaxed);
        (micros > 0).then(|| Duration::from_micros(micros))
    }

    /// The average rounded up to whole seconds, at least 1; `None` until a call was released.
    pub(crate) fn hint_seconds(&self) -> Option<u64> {
        let micros = self.average_micros.load(Ordering::Relaxed);
        (micros > 0).then(|| micros.div_ceil(1_000_000).max(1))
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::HoldTimes;
    use std::time::Duration;

    #[test]
    fn the_hint_is_the_weighted_average_rounded_up_to_seconds() {
        let holds = HoldTimes::default();
        assert_eq!(holds.hint_seconds(), None);
        holds.record(Duration::from_millis(1_200));
        assert_eq!(holds.hint_seconds(), Some(2));
        // 1.2 s - 1.2 s / 8 + 8 s / 8 = 2.05 s: rounded up to 3.
        holds.record(Duration::from_secs(8));
        assert_eq!(holds.hint_seconds(), Some(3));
        let short = HoldTimes::default();
        short.record(Duration::from_micros(3));
        assert_eq!(short.hint_seconds(), Some(1));
    }
}
