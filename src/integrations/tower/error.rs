//! What the layers' configuration and bodies can fail with: [`LayerError`] and [`BoxError`].

use core::fmt;

/// The error type of the layer's bodies and of inner services it accepts (tower's).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A layer's configuration that cannot work, refused when it is built.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{tower::LayerError, LlmBulkhead, tower::LlmLayer};
///
/// let no_queue = LlmBulkhead::builder("m", 1).build()?;
/// let err = LlmLayer::new(no_queue).wait_in_queue(true).unwrap_err();
/// assert_eq!(err, LayerError::NoQueue);
/// assert!(err.to_string().contains("max_queue is 0"));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum LayerError {
    /// [`LlmLayer::wait_in_queue`](crate::tower::LlmLayer::wait_in_queue) or
    /// [`BulkheadLayer::wait_in_queue`](crate::tower::BulkheadLayer::wait_in_queue) on a
    /// bulkhead without a queue: every request that finds no
    /// free slot would be refused at once anyway.
    NoQueue,
}

impl fmt::Display for LayerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LayerError::NoQueue => f.write_str(
                "wait_in_queue(true) on a bulkhead without a queue (max_queue is 0): requests \
                 could only be refused at once; give the bulkhead a queue first",
            ),
        }
    }
}

impl std::error::Error for LayerError {}
