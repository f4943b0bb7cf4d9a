//! [`Verdict`]: what an advisory check (`would_admit`) predicts for a call.

use crate::vocabulary::rejection::RejectReason;

/// The answer of an advisory check ([`LlmBulkhead::would_admit`](crate::LlmBulkhead::would_admit)).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{RejectReason, admission::Verdict};
///
/// assert!(Verdict::Admit.is_admit());
/// assert!(Verdict::Queue.is_admit());
/// assert_eq!(Verdict::Reject(RejectReason::BudgetLimit).reject_reason(), Some(RejectReason::BudgetLimit));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// A slot and the tokens are free now.
    Admit,
    /// The call would wait in the queue (a later timeout is not predicted).
    Queue,
    /// The call would be refused for this reason.
    Reject(RejectReason),
}

impl Verdict {
    /// Whether the call would get in, now or after queueing.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RejectReason, admission::Verdict};
    ///
    /// assert!(!Verdict::Reject(RejectReason::Shutdown).is_admit());
    /// ```
    pub fn is_admit(&self) -> bool {
        !matches!(self, Verdict::Reject(_))
    }

    /// The refusal reason, if the call would be refused.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::admission::Verdict::Admit.reject_reason(), None);
    /// ```
    pub fn reject_reason(&self) -> Option<RejectReason> {
        match *self {
            Verdict::Reject(reason) => Some(reason),
            _ => None,
        }
    }
}
