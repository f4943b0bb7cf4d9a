//! The general bulkhead's errors: why a call was refused ([`BulkheadError`], with the live
//! [`BulkheadState`](crate::bulkhead::BulkheadState) it saw) and why a configuration was ([`BulkheadConfigError`](crate::bulkhead::BulkheadConfigError)).

use core::fmt;
use std::time::Duration;

/// The live occupancy of a [`Bulkhead`](crate::Bulkhead): calls holding a slot and calls
/// waiting for one (the original's `state().bulkhead`, and what its `onBulkheadReject` hook
/// receives).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Bulkhead, bulkhead::BulkheadState};
///
/// let bulkhead = Bulkhead::new(2)?;
/// let _held = bulkhead.try_acquire()?;
/// assert_eq!(bulkhead.state(), BulkheadState::new(1, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct BulkheadState {
    /// Calls holding a slot (including a slot just handed to a queued call that has not been
    /// polled yet).
    pub active: u64,
    /// Calls waiting in the queue.
    pub queued: u64,
}

impl BulkheadState {
    /// A state of `active` calls holding a slot and `queued` waiting (to compare with
    /// [`Bulkhead::state`](crate::Bulkhead::state), or to build one in a test double).
    ///
    /// # Examples
    ///
    /// ```
    /// let state = async_bulkhead_llm::bulkhead::BulkheadState::new(2, 1);
    /// assert_eq!((state.active, state.queued), (2, 1));
    /// ```
    pub const fn new(active: u64, queued: u64) -> BulkheadState {
        BulkheadState { active, queued }
    }
}

/// Why a [`Bulkhead`](crate::Bulkhead) refused a call.
///
/// **Do not retry these errors.** A refused call was shed on purpose: re-queueing it (at once,
/// or in a retry loop) is exactly the load the bulkhead exists to refuse, and it turns one slow
/// dependency into a retry storm. Fail the call, degrade, or answer 503 (the tower layer does).
/// [`is_retryable`](BulkheadError::is_retryable) is `false` for every variant, for retry
/// policies that ask.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Bulkhead, BulkheadError, bulkhead::BulkheadState};
///
/// let bulkhead = Bulkhead::builder(1).max_queue(0).build()?;
/// let _held = bulkhead.try_acquire()?;
/// let err = bulkhead.try_acquire().unwrap_err();
/// assert_eq!(err, BulkheadError::QueueFull { state: BulkheadState::new(1, 0) });
/// assert!(!err.is_retryable());
/// assert!(err.to_string().contains("do not retry"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BulkheadError {
    /// Every slot is taken (`active >= max_concurrent`) and the queue is full
    /// (`queued >= max_queue`; with `max_queue` 0, always). A fail-fast
    /// [`try_acquire`](crate::Bulkhead::try_acquire), which never waits, is refused this way
    /// whenever no slot is free to it.
    QueueFull {
        /// The occupancy the refusal saw.
        state: BulkheadState,
    },
    /// The call waited in the queue for its whole queue timeout, or until its deadline, and no
    /// slot came. It holds no slot and has left the queue.
    QueueTimeout {
        /// How long it waited, by the std clock (`Instant`: under tokio's paused clock, with
        /// the `tokio` feature, the virtual time that ended the wait is not counted here).
        waited: Duration,
        /// The occupancy when it gave up.
        state: BulkheadState,
    },
    /// The bulkhead was closed ([`close`](crate::Bulkhead::close)): before the call arrived, or
    /// while it waited.
    Shutdown {
        /// The occupancy the refusal saw.
        state: BulkheadState,
    },
}

impl BulkheadError {
    /// The occupancy the refusal saw: what the reject hook receives.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::Bulkhead;
    ///
    /// let bulkhead = Bulkhead::builder(1).max_queue(0).build()?;
    /// let _held = bulkhead.try_acquire()?;
    /// assert_eq!(bulkhead.try_acquire().unwrap_err().state().active, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn state(&self) -> BulkheadState {
        match *self {
            BulkheadError::QueueFull { state }
            | BulkheadError::QueueTimeout { state, .. }
            | BulkheadError::Shutdown { state } => state,
        }
    }

    /// Always `false`: a call the bulkhead shed must not be retried (see the type's docs).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::Bulkhead;
    ///
    /// let bulkhead = Bulkhead::new(1)?;
    /// bulkhead.close();
    /// assert!(!bulkhead.try_acquire().unwrap_err().is_retryable());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn is_retryable(&self) -> bool {
        false
    }

    /// A short, stable, snake_case name of the variant (for metrics labels and error bodies):
    /// `bulkhead_queue_full`, `bulkhead_queue_timeout` or `bulkhead_shutdown`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::Bulkhead;
    ///
    /// let bulkhead = Bulkhead::new(1)?;
    /// bulkhead.close();
    /// assert_eq!(bulkhead.try_acquire().unwrap_err().as_str(), "bulkhead_shutdown");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn as_str(&self) -> &'static str {
        match self {
            BulkheadError::QueueFull { .. } => "bulkhead_queue_full",
            BulkheadError::QueueTimeout { .. } => "bulkhead_queue_timeout",
            BulkheadError::Shutdown { .. } => "bulkhead_shutdown",
        }
    }
}

impl fmt::Display for BulkheadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let BulkheadState { active, queued } = self.state();
        match self {
            BulkheadError::QueueFull { .. } => write!(
                f,
                "bulkhead queue full ({active} active, {queued} queued); the call was shed: do not retry it"
            ),
            BulkheadError::QueueTimeout { waited, .. } => write!(
                f,
                "bulkhead queue timeout after {waited:?} ({active} active, {queued} queued); the call was shed: do not retry it"
            ),
            BulkheadError::Shutdown { .. } => {
                f.write_str("bulkhead is shut down; the call was refused: do not retry it")
            }
        }
    }
}

impl std::error::Error for BulkheadError {}

/// Why a [`Bulkhead`](crate::Bulkhead)'s configuration or new limits were refused. Nothing was
/// built or changed.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Bulkhead, bulkhead::BulkheadConfigError};
///
/// // `max_concurrent` 0 would deadlock every call: refused where it is set.
/// assert_eq!(Bulkhead::new(0).unwrap_err(), BulkheadConfigError::ZeroMaxConcurrent);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BulkheadConfigError {
    /// `max_concurrent` is 0: no call could ever run (the original accepted it and deadlocked
    /// every request). It must be at least 1.
    ZeroMaxConcurrent,
    /// `max_concurrent` exceeds what the admission word counts
    /// ([`MAX_CONCURRENT`](crate::limits::MAX_CONCURRENT)).
    MaxConcurrentTooLarge {
        /// The refused value.
        value: usize,
        /// The largest accepted value.
        max: usize,
    },
    /// `max_queue` exceeds what the limits hold (`u32::MAX`).
    MaxQueueTooLarge {
        /// The refused value.
        value: usize,
        /// The largest accepted value.
        max: usize,
    },
    /// A limits revision exceeds the largest revision ([`MAX_REVISION`](crate::limits::MAX_REVISION)),
    /// or `set_max_concurrent` / `set_max_queue` cannot advance it further.
    RevisionTooLarge {
        /// The refused value.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
}

impl fmt::Display for BulkheadConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BulkheadConfigError::ZeroMaxConcurrent => f.write_str(
                "bulkhead max_concurrent must be >= 1 (0 would refuse or deadlock every call)",
            ),
            BulkheadConfigError::MaxConcurrentTooLarge { value, max } => {
                write!(f, "bulkhead max_concurrent ({value}) must be <= {max}")
            }
            BulkheadConfigError::MaxQueueTooLarge { value, max } => {
                write!(f, "bulkhead max_queue ({value}) must be <= {max}")
            }
            BulkheadConfigError::RevisionTooLarge { value, max } => {
                write!(f, "bulkhead limits revision ({value}) must be <= {max}")
            }
        }
    }
}

impl std::error::Error for BulkheadConfigError {}
