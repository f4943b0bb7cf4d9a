//! Per-call options of the LLM bulkhead: priority, reservation override and queue timeout.

use std::time::Duration;

use crate::priority::Priority;
use crate::reservation::Reservation;

/// Options of one acquire or advisory check.
///
/// Every option is a valid value by construction: a [`Reservation`] has been checked when it
/// was built, so options never fail validation.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, Priority, Reservation};
///
/// let options = AcquireOptions::new()
///     .priority(Priority::High)
///     .reservation(Reservation::new(120, 512)?);
/// assert_eq!(options.priority, Priority::High);
/// assert_eq!(options.reservation.map(|r| r.reserved()), Some(632));
/// # Ok::<(), async_bulkhead_llm::RequestError>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AcquireOptions {
    /// The call's priority (default [`Priority::Normal`]).
    pub priority: Priority,
    /// A reservation to use instead of the estimator's (default: none, estimate).
    pub reservation: Option<Reservation>,
    /// The queue timeout of this call (default: none, the bulkhead's).
    pub timeout: Option<Duration>,
}

impl AcquireOptions {
    /// Normal priority, reservation from the bulkhead's estimator.
    ///
    /// # Examples
    ///
    /// ```
    /// let options = async_bulkhead_llm::AcquireOptions::new();
    /// assert!(options.reservation.is_none());
    /// ```
    pub const fn new() -> AcquireOptions {
        AcquireOptions {
            priority: Priority::Normal,
            reservation: None,
            timeout: None,
        }
    }

    /// Sets the priority.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, Priority};
    ///
    /// assert_eq!(AcquireOptions::new().priority(Priority::High).priority, Priority::High);
    /// ```
    pub const fn priority(mut self, priority: Priority) -> AcquireOptions {
        self.priority = priority;
        self
    }

    /// Uses `reservation` instead of calling the estimator. Ignored by a bulkhead without a
    /// token budget (it reserves no tokens).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, Reservation};
    ///
    /// let r = Reservation::new(1, 2)?;
    /// assert_eq!(AcquireOptions::new().reservation(r).reservation, Some(r));
    /// # Ok::<(), async_bulkhead_llm::RequestError>(())
    /// ```
    pub const fn reservation(mut self, reservation: Reservation) -> AcquireOptions {
        self.reservation = Some(reservation);
        self
    }

    /// Bounds how long the call may wait in the queue (overriding the bulkhead's default); it
    /// never limits the call itself. A zero timeout still queues, and gives up at the first
    /// check unless a slot was handed over by then.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::AcquireOptions;
    ///
    /// let options = AcquireOptions::new().timeout(Duration::from_secs(5));
    /// assert_eq!(options.timeout, Some(Duration::from_secs(5)));
    /// ```
    pub const fn timeout(mut self, timeout: Duration) -> AcquireOptions {
        self.timeout = Some(timeout);
        self
    }
}

impl From<Priority> for AcquireOptions {
    fn from(priority: Priority) -> AcquireOptions {
        AcquireOptions::new().priority(priority)
    }
}
