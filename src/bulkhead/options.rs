//! [`WaitOptions`]: how long one call to a [`Bulkhead`](super::Bulkhead) may wait for a slot.

use std::time::{Duration, Instant};

/// How long one call may wait in a [`Bulkhead`](super::Bulkhead)'s queue: a
/// [`timeout`](WaitOptions::timeout) that replaces the bulkhead's queue timeout for this call,
/// and a [`deadline`](WaitOptions::deadline) that ends the wait at an instant, whichever comes
/// first. They bound waiting only: a call that finds a free slot takes it whatever they say,
/// and a call that runs is never cut short by them. The LLM bulkhead's
/// [`AcquireOptions`](crate::AcquireOptions) carry the same two bounds with the same meaning.
///
/// # Examples
///
/// ```
/// use std::time::{Duration, Instant};
/// use async_bulkhead_llm::bulkhead::{Bulkhead, BulkheadError, WaitOptions};
///
/// # futures::executor::block_on(async {
/// let bulkhead = Bulkhead::new(1)?; // a queue timeout of 10 s
/// let _held = bulkhead.acquire().await?;
/// // This call waits 20 ms at most, not 10 s.
/// let options = WaitOptions::new().timeout(Duration::from_millis(20));
/// let refused = bulkhead.acquire_with(options).await.unwrap_err();
/// assert!(matches!(refused, BulkheadError::QueueTimeout { .. }));
/// // A deadline already past: a call that finds no free slot gives up at once.
/// let options = WaitOptions::new().deadline(Instant::now());
/// assert!(bulkhead.acquire_with(options).await.is_err());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaitOptions {
    /// The queue timeout of this call (default: none, the bulkhead's).
    pub timeout: Option<Duration>,
    /// When this call gives up waiting at the latest (default: none).
    pub deadline: Option<Instant>,
}

impl WaitOptions {
    /// The bulkhead's own bound: its queue timeout, no deadline.
    ///
    /// # Examples
    ///
    /// ```
    /// let options = async_bulkhead_llm::bulkhead::WaitOptions::new();
    /// assert_eq!((options.timeout, options.deadline), (None, None));
    /// ```
    pub const fn new() -> WaitOptions {
        WaitOptions {
            timeout: None,
            deadline: None,
        }
    }

    /// Waits at most `timeout` from joining the queue, instead of the bulkhead's queue
    /// timeout (longer or shorter).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::bulkhead::WaitOptions;
    ///
    /// let options = WaitOptions::new().timeout(Duration::from_secs(2));
    /// assert_eq!(options.timeout, Some(Duration::from_secs(2)));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn timeout(mut self, timeout: Duration) -> WaitOptions {
        self.timeout = Some(timeout);
        self
    }

    /// Gives up waiting at `deadline` if the timeout has not ended the wait first (a deadline
    /// already past ends it at once).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use async_bulkhead_llm::bulkhead::WaitOptions;
    ///
    /// let at = Instant::now() + Duration::from_secs(1);
    /// assert_eq!(WaitOptions::new().deadline(at).deadline, Some(at));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn deadline(mut self, deadline: Instant) -> WaitOptions {
        self.deadline = Some(deadline);
        self
    }
}
