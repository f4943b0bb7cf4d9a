//! A [`Bulkhead`]'s limits at run time: [`BulkheadLimits`](crate::bulkhead::BulkheadLimits), and changing them atomically
//! (`apply_limits`, `set_max_concurrent`, `set_max_queue`) through the engine's versioned
//! limits, linearizable with admissions.

use crate::vocabulary::error::LimitsError;
use crate::vocabulary::limits::{ApplyOutcome, Limits, MAX_REVISION};

use super::builder::{check_max_concurrent, check_max_queue};
use super::error::BulkheadConfigError;
use super::face::Bulkhead;

/// A [`Bulkhead`]'s limits: what [`Bulkhead::limits`] returns and
/// [`Bulkhead::apply_limits`] installs.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Bulkhead, bulkhead::BulkheadLimits};
///
/// let bulkhead = Bulkhead::new(5)?;
/// assert_eq!(bulkhead.limits(), BulkheadLimits::new(0, 5).with_max_queue(50));
/// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct BulkheadLimits {
    /// Version of these limits; each applied set must be strictly greater (up to
    /// [`MAX_REVISION`](crate::limits::MAX_REVISION)).
    pub revision: u64,
    /// Calls in flight at most: `1..=MAX_CONCURRENT`.
    pub max_concurrent: u32,
    /// Calls waiting for a slot at most; 0 means never wait.
    pub max_queue: u32,
}

impl BulkheadLimits {
    /// Limits of `revision` with `max_concurrent` slots and no queue (as
    /// [`Limits::new`](crate::Limits::new)); add one with
    /// [`with_max_queue`](BulkheadLimits::with_max_queue). Checked when applied.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, bulkhead::BulkheadLimits};
    ///
    /// let bulkhead = Bulkhead::new(5)?;
    /// assert!(bulkhead.apply_limits(BulkheadLimits::new(1, 8).with_max_queue(20))?.is_applied());
    /// assert_eq!(bulkhead.limits().max_concurrent, 8);
    /// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
    /// ```
    pub const fn new(revision: u64, max_concurrent: u32) -> BulkheadLimits {
        BulkheadLimits {
            revision,
            max_concurrent,
            max_queue: 0,
        }
    }

    /// These limits with a queue of `max_queue` places (0: never wait).
    ///
    /// # Examples
    ///
    /// ```
    /// let limits = async_bulkhead_llm::bulkhead::BulkheadLimits::new(1, 4).with_max_queue(10);
    /// assert_eq!(limits.max_queue, 10);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn with_max_queue(mut self, max_queue: u32) -> BulkheadLimits {
        self.max_queue = max_queue;
        self
    }

    fn of(limits: &Limits) -> BulkheadLimits {
        BulkheadLimits {
            revision: limits.revision,
            max_concurrent: limits.max_concurrent,
            max_queue: limits.max_queue,
        }
    }
}

impl Bulkhead {
    /// The limits in force.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::builder(4).max_queue(8).build()?;
    /// assert_eq!((bulkhead.limits().max_concurrent, bulkhead.limits().max_queue), (4, 8));
    /// # Ok::<(), async_bulkhead_llm::bulkhead::BulkheadConfigError>(())
    /// ```
    pub fn limits(&self) -> BulkheadLimits {
        BulkheadLimits::of(&self.core.engine().limits())
    }

    /// Installs `next` atomically if its revision is greater than the current one; returns
    /// what it did: [`Applied`](ApplyOutcome::Applied) with the limits replaced and those now
    /// in force, or [`Stale`](ApplyOutcome::Stale) (nothing changed), as
    /// [`LlmBulkhead::apply_limits`](crate::LlmBulkhead::apply_limits) does. Its values are
    /// checked first: a `max_concurrent` of 0 is an error even with a stale revision.
    ///
    /// Every admission is decided entirely under the old limits or entirely under the new.
    /// Calls in flight keep their slots: lowering `max_concurrent` below them refuses
    /// newcomers until enough have released. Raising it hands the new slots to queued calls
    /// at once, oldest first; lowering `max_queue` below the calls already queued lets them
    /// wait on.
    ///
    /// # Errors
    ///
    /// [`BulkheadConfigError::ZeroMaxConcurrent`](crate::bulkhead::BulkheadConfigError::ZeroMaxConcurrent), `MaxConcurrentTooLarge` or
    /// `RevisionTooLarge`; nothing changes.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::bulkhead::{Bulkhead, BulkheadConfigError, BulkheadLimits};
    /// use async_bulkhead_llm::limits::ApplyOutcome;
    ///
    /// let bulkhead = Bulkhead::new(5)?;
    /// let next = BulkheadLimits::new(1, 10).with_max_queue(20);
    /// let previous = bulkhead.limits();
    /// assert_eq!(bulkhead.apply_limits(next)?, ApplyOutcome::Applied { previous, current: next });
    /// assert_eq!(bulkhead.apply_limits(next)?, ApplyOutcome::Stale { current: next });
    /// let zero = BulkheadLimits::new(2, 0).with_max_queue(20);
    /// assert_eq!(bulkhead.apply_limits(zero), Err(BulkheadConfigError::ZeroMaxConcurrent));
    /// assert_eq!(bulkhead.limits(), next);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn apply_limits(
        &self,
        next: BulkheadLimits,
    ) -> Result<ApplyOutcome<BulkheadLimits>, BulkheadConfigError> {
        check_max_concurrent(next.max_concurrent as usize)?;
        if next.revision > MAX_REVISION {
            return Err(BulkheadConfigError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            });
        }
        let limits = Limits::new(next.revision, next.max_concurrent).with_max_queue(next.max_queue);
        match self.core.engine().apply_limits(limits) {
            Ok(outcome) => Ok(outcome.map(|limits| BulkheadLimits::of(&limits))),
            Err(error) => Err(config_error(error)),
        }
    }

    /// Sets `max_concurrent` at the next revision; returns the limits installed.
    ///
    /// # Errors
    ///
    /// [`BulkheadConfigError::ZeroMaxConcurrent`](crate::bulkhead::BulkheadConfigError::ZeroMaxConcurrent) or `MaxConcurrentTooLarge`, and
    /// `RevisionTooLarge` once the revision cannot advance; nothing changes.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Bulkhead, bulkhead::BulkheadConfigError};
    ///
    /// let bulkhead = Bulkhead::new(5)?;
    /// assert_eq!(bulkhead.set_max_concurrent(8)?.max_concurrent, 8);
    /// assert_eq!(bulkhead.set_max_concurrent(0), Err(BulkheadConfigError::ZeroMaxConcurrent));
    /// assert_eq!(bulkhead.limits().revision, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_max_concurrent(
        &self,
        max_concurrent: usize,
    ) -> Result<BulkheadLimits, BulkheadConfigError> {
        let max_concurrent = check_max_concurrent(max_concurrent)?;
        self.update(|limits| limits.max_concurrent = max_concurrent)
    }

    /// Sets `max_queue` at the next revision; returns the limits installed.
    ///
    /// # Errors
    ///
    /// [`BulkheadConfigError::MaxQueueTooLarge`](crate::bulkhead::BulkheadConfigError::MaxQueueTooLarge) above `u32::MAX`, and `RevisionTooLarge`
    /// once the revision cannot advance; nothing changes.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(5)?;
    /// assert_eq!(bulkhead.set_max_queue(0)?.max_queue, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn set_max_queue(&self, max_queue: usize) -> Result<BulkheadLimits, BulkheadConfigError> {
        let max_queue = check_max_queue(max_queue)?;
        self.update(|limits| limits.max_queue = max_queue)
    }

    /// Applies `change` to the limits in force at the next revision, again if another writer
    /// got in between.
    fn update(
        &self,
        change: impl Fn(&mut BulkheadLimits),
    ) -> Result<BulkheadLimits, BulkheadConfigError> {
        loop {
            let mut next = self.limits();
            next.revision += 1;
            change(&mut next);
            if self.apply_limits(next)?.is_applied() {
                return Ok(next);
            }
        }
    }
}

/// The engine's refusal of limits already checked here: only the revision can be left.
fn config_error(error: LimitsError) -> BulkheadConfigError {
    match error {
        LimitsError::MaxConcurrentTooLarge { value, max } => {
            BulkheadConfigError::MaxConcurrentTooLarge {
                value: value as usize,
                max: max as usize,
            }
        }
        LimitsError::RevisionTooLarge { value, max } => {
            BulkheadConfigError::RevisionTooLarge { value, max }
        }
        other => unreachable!("limits without budget or classes refused: {other}"),
    }
}
