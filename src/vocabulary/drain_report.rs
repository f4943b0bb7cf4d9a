//! [`DrainReport`]: where a drain with a deadline stood when it ended.

/// What [`LlmBulkhead::drain_timeout`](crate::LlmBulkhead::drain_timeout) found.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::LlmBulkhead;
///
/// # futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
/// let report = bulkhead.drain_timeout(std::time::Duration::ZERO).await;
/// assert!(report.drained);
/// assert_eq!((report.in_flight, report.pending), (0, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DrainReport {
    /// Whether the bulkhead became idle before the deadline.
    pub drained: bool,
    /// Admissions still unsettled at the deadline: holding a slot, or holding tokens after
    /// giving their borrowed slot back (0 when drained).
    pub in_flight: u64,
    /// Calls still queued at the deadline (0 when drained).
    pub pending: u64,
}
