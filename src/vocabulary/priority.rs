//! [`Priority`]: the one per-call choice the engine itself knows about (it decides which part
//! of the token budget a call may fill).

/// A call's priority. High-priority calls may use the whole token budget; normal ones leave the
/// high-priority reserve untouched. With the `serde` feature it serializes as its wire name
/// ([`as_str`](Priority::as_str)).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::Priority;
///
/// assert_eq!(Priority::default(), Priority::Normal);
/// assert_eq!(Priority::High.as_str(), "high");
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Priority {
    /// Ordinary traffic (the default).
    #[default]
    Normal,
    /// Traffic that may dip into the high-priority reserve.
    High,
}

impl Priority {
    /// The priority's wire name.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Priority::Normal.as_str(), "normal");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            Priority::Normal => "normal",
            Priority::High => "high",
        }
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Priority {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}
