//! Per-call options of the LLM bulkhead: priority, reservation override, queue timeout and
//! admission class ([`AcquireOptions`]), and what `run` adds to them ([`RunOptions`]).

use std::time::Duration;

use crate::admission_class::AdmissionClass;
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
    /// The call's admission class (default: none, the bulkhead's default class). Only a
    /// bulkhead with admission classes accepts one, and only its own.
    pub class: Option<AdmissionClass>,
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
            class: None,
        }
    }

    /// Admits the call in admission class `class` (resolved once with
    /// [`LlmBulkhead::class`](crate::LlmBulkhead::class)).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, AdmissionClasses, ClassLimits, LlmBulkhead, LlmRequest};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 2)
    ///     .admission_classes(AdmissionClasses::new("a").class("a", ClassLimits::new()).class("b", ClassLimits::new()))
    ///     .build()?;
    /// let b = bulkhead.class("b")?;
    /// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new().class(b))?;
    /// assert_eq!(permit.class(), Some(b));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn class(mut self, class: AdmissionClass) -> AcquireOptions {
        self.class = Some(class);
        self
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

    /// These options for a [`run`](crate::LlmBulkhead::run), with a borrowed-slot deadline
    /// (see [`RunOptions::borrowed_concurrency_deadline`]).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::AcquireOptions;
    ///
    /// let options = AcquireOptions::new().borrowed_concurrency_deadline(Duration::from_secs(30));
    /// assert_eq!(options.borrowed_concurrency_deadline, Some(Duration::from_secs(30)));
    /// ```
    pub const fn borrowed_concurrency_deadline(self, deadline: Duration) -> RunOptions {
        RunOptions::new(self).borrowed_concurrency_deadline(deadline)
    }
}

/// Options of one [`run`](crate::LlmBulkhead::run): the [`AcquireOptions`] of its admission,
/// and a borrowed-slot deadline. Every `run` accepts plain `AcquireOptions` too (they convert).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::{AcquireOptions, Priority, RunOptions};
///
/// let options = RunOptions::from(AcquireOptions::new().priority(Priority::High))
///     .borrowed_concurrency_deadline(Duration::from_secs(10));
/// assert_eq!(options.acquire.priority, Priority::High);
/// assert_eq!(options.borrowed_concurrency_deadline, Some(Duration::from_secs(10)));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunOptions {
    /// How the call is admitted.
    pub acquire: AcquireOptions,
    /// How long the call may keep a slot it borrowed from the shared pool (default: no limit).
    pub borrowed_concurrency_deadline: Option<Duration>,
}

impl RunOptions {
    /// Run options admitting with `acquire`, without a deadline.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, RunOptions};
    ///
    /// assert_eq!(RunOptions::new(AcquireOptions::new()).borrowed_concurrency_deadline, None);
    /// ```
    pub const fn new(acquire: AcquireOptions) -> RunOptions {
        RunOptions {
            acquire,
            borrowed_concurrency_deadline: None,
        }
    }

    /// Bounds how long the call may keep a slot it borrowed from the shared pool (its class's
    /// floor was full when it was admitted; see
    /// [`Admission::resources`](crate::Admission::resources)). If the callback has not
    /// finished when the deadline passes, `run` gives the slot back at once, drops the
    /// callback's future, settles its tokens with the last usage it reported, and returns
    /// [`RunError::BorrowedConcurrencyDeadline`](crate::RunError::BorrowedConcurrencyDeadline).
    /// A call that did not borrow its slot (or that gave it back itself) is never cut. The
    /// deadline needs no runtime timer (the crate's own timer thread wakes the task).
    ///
    /// A zero deadline is refused when `run` starts, with
    /// [`RequestError::ZeroBorrowedConcurrencyDeadline`](crate::RequestError::ZeroBorrowedConcurrencyDeadline),
    /// even when it would not apply.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{AcquireOptions, RunOptions};
    ///
    /// let options = RunOptions::new(AcquireOptions::new())
    ///     .borrowed_concurrency_deadline(Duration::from_millis(1500));
    /// assert_eq!(options.borrowed_concurrency_deadline, Some(Duration::from_millis(1500)));
    /// ```
    pub const fn borrowed_concurrency_deadline(mut self, deadline: Duration) -> RunOptions {
        self.borrowed_concurrency_deadline = Some(deadline);
        self
    }
}

impl From<AcquireOptions> for RunOptions {
    fn from(acquire: AcquireOptions) -> RunOptions {
        RunOptions::new(acquire)
    }
}

impl From<Priority> for AcquireOptions {
    fn from(priority: Priority) -> AcquireOptions {
        AcquireOptions::new().priority(priority)
    }
}
